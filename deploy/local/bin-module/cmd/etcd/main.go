// Command etcd is the upstream etcd server, built from go.etcd.io/etcd/server/v3 at the version
// pinned in ../../versions.env. etcd publishes no `main` package inside the server module, so
// this two-line wrapper is the whole of it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
