// An HTTPS server and client in one stdlib-only program: the Go crypto/tls binary that
// tests/test_capture_goelf.py builds and analyzes (capture/ebpf/goelf.py). Run, it serves one
// request on 127.0.0.1 with a throwaway certificate, fetches it and prints the body.
// Run as `https_roundtrip stay`, it does the same and then runs until its stdin closes.
// Run as `https_roundtrip layout`, it prints (JSON) the field offsets of the path from a *tls.Conn to
// its socket's fd as this binary's own reflect sees them: the oracle for the DWARF/table offsets.
package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"reflect"
	"time"
	"unsafe"
)

func selfSigned() (tls.Certificate, *x509.CertPool) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		panic(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		panic(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		panic(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pool
}

func field(t reflect.Type, name string) reflect.StructField {
	f, ok := t.FieldByName(name)
	if !ok {
		panic(t.String() + " has no field " + name)
	}
	return f
}

// layout: the offsets capture/ebpf/goelf.py calls GoStructOffsets, and the type of each field.
func layout() {
	tlsConn := field(reflect.TypeOf((*tls.Conn)(nil)).Elem(), "conn")
	tcpConn := field(reflect.TypeOf((*net.TCPConn)(nil)).Elem(), "conn")
	connFd := field(tcpConn.Type, "fd")
	pfd := field(connFd.Type.Elem(), "pfd")
	sysfd := field(pfd.Type, "Sysfd")
	out := map[string]interface{}{
		"tls_conn_conn":   tlsConn.Offset,
		"iface_data":      unsafe.Sizeof(uintptr(0)), // an interface value is {itab or type word, data word}
		"tcpconn_conn_fd": tcpConn.Offset + connFd.Offset,
		"netfd_pfd":       pfd.Offset,
		"fd_sysfd":        sysfd.Offset,
		"types": []string{tlsConn.Type.String(), tcpConn.Type.String(), connFd.Type.String(),
			pfd.Type.String(), sysfd.Type.String()},
	}
	b, err := json.Marshal(out)
	if err != nil {
		panic(err)
	}
	fmt.Println(string(b))
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "layout" {
		layout()
		return
	}
	cert, pool := selfSigned()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		panic(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello over go tls: %s", r.URL.Path)
	})}
	go srv.Serve(ln)
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	resp, err := client.Get("https://" + ln.Addr().String() + "/ping")
	if err != nil {
		panic(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(string(body))
	if len(os.Args) > 1 && os.Args[1] == "stay" { // keep running (serving) until stdin closes
		io.Copy(io.Discard, os.Stdin)
	}
	srv.Close()
	os.Exit(0)
}
