// A grpc-go server over TLS that needs no generated code: every method of every service is answered by
// one handler with raw bytes (a codec that passes []byte through). tests/test_capture_go_tls.py builds it
// in GOPATH mode against Debian's golang-google-grpc-dev and calls it with grpcio.
//
//	grpc_tls_server CERT KEY   listens on 127.0.0.1:0, prints "listening PORT", then one line per call
//	                           ("CALL /service/Method CODE"), until its stdin closes.
//
// /t.S/Echo answers "echo:" + the request; any other method fails with NOT_FOUND.
package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
)

type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string   { return "proto" } // what the client's content-type names
func (rawCodec) String() string { return "proto" }

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: grpc_tls_server CERT KEY")
		os.Exit(2)
	}
	creds, err := credentials.NewServerTLSFromFile(os.Args[1], os.Args[2])
	if err != nil {
		panic(err)
	}
	var mu sync.Mutex
	out := bufio.NewWriter(os.Stdout)
	say := func(format string, args ...interface{}) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(out, format+"\n", args...)
		out.Flush()
	}
	handler := func(srv interface{}, stream grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(stream)
		var req []byte
		if err := stream.RecvMsg(&req); err != nil {
			return err
		}
		if method != "/t.S/Echo" {
			say("CALL %s %d", method, codes.NotFound)
			return status.Error(codes.NotFound, "no such thing")
		}
		resp := append([]byte("echo:"), req...)
		say("CALL %s %d", method, codes.OK)
		return stream.SendMsg(&resp)
	}
	server := grpc.NewServer(grpc.Creds(creds), grpc.CustomCodec(rawCodec{}), grpc.UnknownServiceHandler(handler))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	say("listening %d", ln.Addr().(*net.TCPAddr).Port)
	go server.Serve(ln)
	io.Copy(io.Discard, os.Stdin)
	server.Stop()
}
