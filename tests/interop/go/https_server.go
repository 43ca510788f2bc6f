// A Go crypto/tls service and client, stdlib only: the peer tests/test_capture_go_tls.py records.
//
//	https_server serve DIR [PORT]  writes DIR/cert.pem (a throwaway self-signed certificate for
//	                           127.0.0.1), listens on 127.0.0.1:PORT (default 0: any free port) with
//	                           HTTP/1.1 and HTTP/2 (ALPN),
//	                           prints "listening PORT", then one line per answered request
//	                           ("CALL METHOD PATH STATUS BODYLEN"), until its stdin closes.
//	https_server get CAFILE URL...   waits for a line on stdin, then on one keep-alive connection
//	                           (HTTP/1.1) a GET per URL, printing "GOT STATUS BODYLEN" per answer.
//
// A request to /size/N is answered with N bytes ("0123456789" repeated): a large answer that Go writes
// in one Write call and the client reads in many Read calls.
package main

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

func selfSigned() (tls.Certificate, []byte) {
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
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key},
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func serve(dir string, port string) {
	cert, certPEM := selfSigned()
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
	if len(os.Args) == 3 && os.Args[1] == "serve" {
		serve(os.Args[2], "0")
	} else if len(os.Args) == 4 && os.Args[1] == "serve" {
		serve(os.Args[2], os.Args[3])
	} else if len(os.Args) >= 4 && os.Args[1] == "get" {
		get(os.Args[2], os.Args[3:])
	} else {
		fmt.Fprintln(os.Stderr, "usage: https_server serve DIR [PORT] | get CAFILE URL...")
		os.Exit(2)
	}
}
