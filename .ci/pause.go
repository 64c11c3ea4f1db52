// The pod sandbox's process for the real node of the Kubernetes tests (.ci/kube-tools builds it,
// static): it holds the pod's namespaces, reaps the orphans it inherits, and exits 0 on
// SIGINT or SIGTERM. Nothing else: it opens no file and no socket.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
