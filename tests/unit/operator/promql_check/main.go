// promql-check: parse PromQL expressions with Prometheus's own parser (github.com/prometheus/
// prometheus/promql/parser) and name the metrics each selects. Reads a JSON list of expressions on
// stdin, writes a JSON list of {"metrics": [...], "error": "..."} in the same order. The chart's
// dashboard, alert rules and adapter queries are checked with it (tests/unit/operator/
// test_observability_chart.py): each parses, and each metric it names is one something exports.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Metrics []string `json:"metrics"`
	Error   string   `json:"error,omitempty"`
}

func metrics(expr string) ([]string, error) {
	node, err := parser.ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
				name = m.Value
			}
		}
		if name == "" {
			name = "<no metric name: " + vs.String() + ">"
		}
		seen[name] = true
		return nil
	})
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	return out, nil
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "stdin: a JSON list of PromQL expressions:", err)
		os.Exit(2)
	}
	out := make([]result, len(exprs))
	for i, e := range exprs {
		names, err := metrics(e)
		out[i].Metrics = names
		if err != nil {
			out[i].Error = err.Error()
		}
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
