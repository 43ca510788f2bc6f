// An HTTPS server and client in one stdlib-only program: the Go crypto/tls binary that
// tests/test_capture_goelf.py builds and analyzes (capture/ebpf/goelf.py). Run, it serves one
// request on 127.0.0.1 with a throwaway certificate, fetches it and prints the body.
// Run as `https_roundtrip stay`, it does the same and then runs until its stdin closes.
// Run as `https_roundtrip layout`, it prints (JSON) the field offsets of the path from a *tls.Conn to
// its socket's fd as this binary's own reflect sees them: the oracle for the DWARF/table offsets.
//
// The Go peer that tests/test_capture_go_tls.py records (and bench/tls_capture_overhead.py loads):
//
//	https_roundtrip serve DIR [PORT]  writes DIR/cert.pem (a throwaway self-signed certificate for
//	                           127.0.0.1), listens on 127.0.0.1:PORT (default 0: any free port) with
//	                           HTTP/1.1 and HTTP/2 (ALPN), prints "listening PORT", then one line per
//	                           answered request ("CALL METHOD PATH STATUS BODYLEN"), until its stdin closes.
//	https_roundtrip get CAFILE URL...  waits for a line on stdin, then on one keep-alive connection
//	                           (HTTP/1.1) a GET per URL, printing "GOT STATUS BODYLEN" per answer.
//
// A request to /size/N is answered with N bytes ("0123456789" repeated): a large answer that Go writes
// in one Write call and the client reads in many Read calls.
//
//	https_roundtrip closerace DIR  writes DIR/cert.pem, listens on 127.0.0.1 (prints "listening PORT");
//	                           on each connection, after the client's "ping\n", one goroutine writes up
//	                           to 64 numbered 256-byte records while another closes the connection after a
//	                           random 0-0.6 ms: a close that races a Write in flight, as net/http's HTTP/2
//	                           server's does when its client goes. Runs until its stdin closes.
package main

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	mathrand "math/rand"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"
)

// selfSigned: a throwaway certificate for 127.0.0.1 (its own CA), a pool that trusts it, and its PEM.
func selfSigned() (tls.Certificate, *x509.CertPool, []byte) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		panic(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
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
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pool,
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
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

func serve(dir string, port string) {
	cert, _, certPEM := selfSigned()
	if err := os.WriteFile(filepath.Join(dir, "cert.pem"), certPEM, 0o600); err != nil {
		panic(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:"+port)
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
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		status := http.StatusOK
		var answer string
		if n, err := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/size/")); err == nil && strings.HasPrefix(r.URL.Path, "/size/") {
			answer = strings.Repeat("0123456789", n/10+1)[:n]
		} else if r.URL.Path == "/missing" {
			status = http.StatusNotFound
			answer = "no such thing"
		} else {
			answer = fmt.Sprintf("go saw %s %s with %d bytes", r.Method, r.URL.RequestURI(), len(body))
		}
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(status)
		io.WriteString(w, answer)
		say("CALL %s %s %d %d", r.Method, r.URL.RequestURI(), status, len(answer))
	})
	srv := &http.Server{Handler: handler, TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}}}
	say("listening %d", ln.Addr().(*net.TCPAddr).Port)
	go srv.ServeTLS(ln, "", "") // ServeTLS adds "h2" to the ALPN protocols
	io.Copy(io.Discard, os.Stdin)
	srv.Close()
}

func closerace(dir string) {
	cert, _, certPEM := selfSigned()
	if err := os.WriteFile(filepath.Join(dir, "cert.pem"), certPEM, 0o600); err != nil {
		panic(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		panic(err)
	}
	fmt.Printf("listening %d\n", ln.Addr().(*net.TCPAddr).Port)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func(conn net.Conn) {
				ping := make([]byte, 5)
				if _, err := io.ReadFull(conn, ping); err != nil {
					conn.Close()
					return
				}
				go func() {
					for i := 0; i < 64; i++ {
						record := fmt.Sprintf("%06d", i) + strings.Repeat("x", 250)
						if _, err := io.WriteString(conn, record); err != nil {
							return
						}
					}
				}()
				time.Sleep(time.Duration(mathrand.Intn(600)) * time.Microsecond)
				conn.Close()
			}(conn)
		}
	}()
	io.Copy(io.Discard, os.Stdin)
	ln.Close()
}

func get(caFile string, urls []string) {
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		panic(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	bufio.NewReader(os.Stdin).ReadString('\n')
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool},
		MaxIdleConnsPerHost: 1}}
	for _, u := range urls {
		resp, err := client.Get(u)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("GOT %d %d\n", resp.StatusCode, len(body))
	}
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "layout" {
		layout()
		return
	}
	if len(os.Args) == 3 && os.Args[1] == "serve" {
		serve(os.Args[2], "0")
		return
	}
	if len(os.Args) == 4 && os.Args[1] == "serve" {
		serve(os.Args[2], os.Args[3])
		return
	}
	if len(os.Args) >= 4 && os.Args[1] == "get" {
		get(os.Args[2], os.Args[3:])
		return
	}
	if len(os.Args) == 3 && os.Args[1] == "closerace" {
		closerace(os.Args[2])
		return
	}
	cert, pool, _ := selfSigned()
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
