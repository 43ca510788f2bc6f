// A Go program that uses the network (package net) but not crypto/tls: the "Go binary without
// crypto/tls" case of tests/test_capture_goelf.py (capture/ebpf/goelf.py).
package main

import (
	"fmt"
	"net"
	"os"
)

func main() {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	fmt.Println("listening on", ln.Addr())
	ln.Close()
	os.Exit(0)
}
