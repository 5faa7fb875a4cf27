// Command fakecri serves Kubernetes' fake CRI runtime (k8s.io/cri-client/pkg/fake) on a unix socket,
// the runtime of gpushard's node tier: the kubelet's admission, device manager, PodResources API and
// DRA manager are its own whatever the runtime does, and this runtime starts no container.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"k8s.io/cri-client/pkg/fake"
)

func main() {
	listen := flag.String("listen", "", "the unix socket to serve the CRI on (a path)")
	flag.Parse()
	if *listen == "" {
		fmt.Fprintln(os.Stderr, "fakecri: --listen PATH is required")
		os.Exit(2)
	}
	runtime := fake.NewFakeRemoteRuntime()
	if err := runtime.Start("unix://" + *listen); err != nil {
		fmt.Fprintf(os.Stderr, "fakecri: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("fakecri: serving the CRI on %s\n", *listen)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
	runtime.Stop()
	_ = os.Remove(*listen)
}
