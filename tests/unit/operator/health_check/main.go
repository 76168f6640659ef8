// health-check: what kstatus (sigs.k8s.io/cli-utils pkg/kstatus/status, the library Flux and
// `kubectl wait`-style tools compute status with) and Argo CD's Lua health runner make of
// MoEDeployment objects. Reads one JSON object per line on stdin, writes one JSON line per object:
// {"kstatus": ..., "kstatusMessage": ..., "argo": ..., "argoMessage": ...}.
//
// The Lua runs as Argo CD runs a health script from argocd-cm (argoproj/argo-cd util/lua/lua.go,
// VM.runLua and decodeValue): gopher-lua with SkipOpenLibs, then only package, base and table
// opened (no string or math library: a script must not use them), the object as the global `obj`,
// and the returned table's status checked against Argo's health codes.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"

	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type result struct {
	Kstatus        string `json:"kstatus"`
	KstatusMessage string `json:"kstatusMessage"`
	Argo           string `json:"argo"`
	ArgoMessage    string `json:"argoMessage"`
	Error          string `json:"error,omitempty"`
}

var argoCodes = map[string]bool{"Unknown": true, "Progressing": true, "Suspended": true, "Healthy": true,
	"Degraded": true, "Missing": true}

func decodeValue(L *lua.LState, value interface{}) lua.LValue {
	switch v := value.(type) {
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case int64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case []interface{}:
		arr := L.CreateTable(len(v), 0)
		for _, item := range v {
			arr.Append(decodeValue(L, item))
		}
		return arr
	case map[string]interface{}:
		tbl := L.CreateTable(0, len(v))
		for key, item := range v {
			tbl.RawSetH(lua.LString(key), decodeValue(L, item))
		}
		return tbl
	}
	return lua.LNil
}

func argo(obj map[string]interface{}, script string) (string, string, error) {
	L := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer L.Close()
	for _, lib := range []struct {
		n string
		f lua.LGFunction
	}{{lua.LoadLibName, lua.OpenPackage}, {lua.BaseLibName, lua.OpenBase}, {lua.TabLibName, lua.OpenTable}} {
		if err := L.CallByParam(lua.P{Fn: L.NewFunction(lib.f), NRet: 0, Protect: true}, lua.LString(lib.n)); err != nil {
			return "", "", err
		}
	}
	L.SetGlobal("obj", decodeValue(L, obj))
	if err := L.DoString(script); err != nil {
		return "", "", err
	}
	ret, ok := L.Get(-1).(*lua.LTable)
	if !ok {
		return "", "", fmt.Errorf("expect table output from Lua script, not %s", L.Get(-1).Type())
	}
	st, msg := ret.RawGetString("status"), ret.RawGetString("message")
	code := st.String()
	if st.Type() != lua.LTString || !argoCodes[code] {
		return "Unknown", "Lua returned an invalid health status", nil
	}
	m := ""
	if msg.Type() == lua.LTString {
		m = msg.String()
	}
	return code, m, nil
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: health-check HEALTH.lua < objects.jsonl")
		os.Exit(2)
	}
	script, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var r result
		u := &unstructured.Unstructured{}
		// UnmarshalJSON keeps integers int64, as objects read from the API server are
		if err := u.UnmarshalJSON(in.Bytes()); err != nil {
			r.Error = err.Error()
		} else if res, err := status.Compute(u); err != nil {
			r.Error = err.Error()
		} else {
			r.Kstatus, r.KstatusMessage = res.Status.String(), res.Message
			if r.Argo, r.ArgoMessage, err = argo(u.Object, string(script)); err != nil {
				r.Error = "lua: " + err.Error()
			}
		}
		if err := out.Encode(r); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
