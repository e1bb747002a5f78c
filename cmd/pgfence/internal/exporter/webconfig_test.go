package exporter

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
)

// testCA issues certificates for the TLS tests.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns PEM certificate and key for cn, valid for 127.0.0.1.
func (ca *testCA) issue(t *testing.T, cn string, usage x509.ExtKeyUsage) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

// serveTLS serves h over TLS with cfg as configured (httptest's StartTLS would
// put its own certificate in front of GetCertificate).
func serveTLS(t *testing.T, cfg *tls.Config, h http.Handler) (srv struct{ URL string }) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &http.Server{Handler: h, TLSConfig: cfg, ReadHeaderTimeout: 10 * time.Second, ErrorLog: log.New(io.Discard, "", 0)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = s.ServeTLS(ln, "", "")
	}()
	t.Cleanup(func() {
		_ = s.Close()
		<-done
	})
	srv.URL = "https://" + ln.Addr().String()
	return srv
}

func writeFile(t *testing.T, dir, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func hash(t *testing.T, password string) string {
	t.Helper()
	h, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	return string(h)
}

var okHandler = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })

func TestExportWebConfigBasicAuth(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	// htpasswd writes $2y$ hashes; Go's bcrypt writes $2a$ (the same algorithm).
	htpasswd := strings.Replace(hash(t, "x"), "$2a$", "$2y$", 1)
	path := writeFile(t, dir, "web.yml", []byte("basic_auth_users:\n  prometheus: "+hash(t, "s3cret")+"\n  other: "+htpasswd+"\n"))
	c, err := LoadWebConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if !c.HasBasicAuth() || c.TLS() != nil {
		t.Fatalf("basic auth %v, TLS %v", c.HasBasicAuth(), c.TLS())
	}
	h := c.Wrap(okHandler)
	for _, tc := range []struct {
		user, pass string
		set        bool
		want       int
	}{
		{set: false, want: http.StatusUnauthorized},
		{"prometheus", "wrong", true, http.StatusUnauthorized},
		{"nobody", "s3cret", true, http.StatusUnauthorized},
		{"other", "s3cret", true, http.StatusUnauthorized},
		{"prometheus", "s3cret", true, http.StatusOK},
		{"prometheus", "s3cret", true, http.StatusOK}, // from the cache of good checks
		{"prometheus", "s3cret ", true, http.StatusUnauthorized},
		{"other", "x", true, http.StatusOK},
	} {
		r := httptest.NewRequest(http.MethodGet, "/metrics", nil)
		if tc.set {
			r.SetBasicAuth(tc.user, tc.pass)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		if rec.Code != tc.want {
			t.Errorf("%q/%q: %d, want %d", tc.user, tc.pass, rec.Code, tc.want)
		}
		if rec.Code == http.StatusUnauthorized && !strings.HasPrefix(rec.Header().Get("WWW-Authenticate"), "Basic ") {
			t.Errorf("401 without a Basic challenge: %q", rec.Header().Get("WWW-Authenticate"))
		}
	}
	// No users: the handler is passed through.
	var none *WebConfig
	if none.Wrap(okHandler) == nil || none.HasBasicAuth() || none.TLS() != nil {
		t.Fatal("nil config")
	}
}

func TestExportWebConfigTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := newTestCA(t, "server CA")
	crt, key := ca.issue(t, "exporter", x509.ExtKeyUsageServerAuth)
	writeFile(t, dir, "server.crt", crt)
	writeFile(t, dir, "server.key", key)
	// Relative names are taken from the file's directory.
	path := writeFile(t, dir, "web.yml", []byte("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  min_version: TLS13\n"))
	c, err := LoadWebConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	srv := serveTLS(t, c.TLS(), okHandler)

	roots := x509.NewCertPool()
	roots.AddCert(ca.cert)
	client := func(cfg *tls.Config) *http.Client {
		return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}, Timeout: 30 * time.Second}
	}
	resp, err := client(&tls.Config{RootCAs: roots}).Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.TLS.Version != tls.VersionTLS13 || resp.TLS.PeerCertificates[0].Subject.CommonName != "exporter" {
		t.Fatalf("status %d, TLS %x", resp.StatusCode, resp.TLS.Version)
	}
	if _, err := client(&tls.Config{RootCAs: roots, MaxVersion: tls.VersionTLS12}).Get(srv.URL); err == nil {
		t.Fatal("TLS 1.2 accepted with min_version TLS13")
	}

	// A renewed certificate is picked up without a restart.
	crt2, key2 := ca.issue(t, "exporter-renewed", x509.ExtKeyUsageServerAuth)
	writeFile(t, dir, "server.key", key2)
	writeFile(t, dir, "server.crt", crt2)
	future := time.Now().Add(time.Minute)
	_ = os.Chtimes(filepath.Join(dir, "server.crt"), future, future)
	resp, err = client(&tls.Config{RootCAs: roots}).Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if cn := resp.TLS.PeerCertificates[0].Subject.CommonName; cn != "exporter-renewed" {
		t.Fatalf("served %q after renewal", cn)
	}
	// A broken file keeps the previous pair.
	writeFile(t, dir, "server.crt", []byte("not a certificate"))
	resp, err = client(&tls.Config{RootCAs: roots}).Get(srv.URL)
	if err != nil {
		t.Fatalf("after a broken write: %v", err)
	}
	resp.Body.Close()
}

func TestExportWebConfigClientCerts(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	serverCA, clientCA := newTestCA(t, "server CA"), newTestCA(t, "client CA")
	crt, key := serverCA.issue(t, "exporter", x509.ExtKeyUsageServerAuth)
	writeFile(t, dir, "server.crt", crt)
	writeFile(t, dir, "server.key", key)
	writeFile(t, dir, "clients.crt", clientCA.pem)
	path := writeFile(t, dir, "web.yml", []byte("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_ca_file: clients.crt\n"))
	c, err := LoadWebConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if c.TLS().ClientAuth != tls.RequireAndVerifyClientCert {
		t.Fatalf("client auth %v", c.TLS().ClientAuth)
	}
	srv := serveTLS(t, c.TLS(), okHandler)
	roots := x509.NewCertPool()
	roots.AddCert(serverCA.cert)
	get := func(certs []tls.Certificate) error {
		cl := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: certs}}, Timeout: 30 * time.Second}
		resp, err := cl.Get(srv.URL)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := get(nil); err == nil {
		t.Fatal("no client certificate accepted")
	}
	ccrt, ckey := clientCA.issue(t, "prometheus", x509.ExtKeyUsageClientAuth)
	pair, err := tls.X509KeyPair(ccrt, ckey)
	if err != nil {
		t.Fatal(err)
	}
	if err := get([]tls.Certificate{pair}); err != nil {
		t.Fatalf("client certificate refused: %v", err)
	}
	rogue, rkey := serverCA.issue(t, "rogue", x509.ExtKeyUsageClientAuth)
	rpair, _ := tls.X509KeyPair(rogue, rkey)
	if err := get([]tls.Certificate{rpair}); err == nil {
		t.Fatal("client certificate of another CA accepted")
	}
}

func TestExportWebConfigRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := newTestCA(t, "ca")
	crt, key := ca.issue(t, "exporter", x509.ExtKeyUsageServerAuth)
	writeFile(t, dir, "s.crt", crt)
	writeFile(t, dir, "s.key", key)
	writeFile(t, dir, "ca.crt", ca.pem)
	good := hash(t, "pw")
	for name, tc := range map[string]struct{ yaml, want string }{
		"unknown key":         {"tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n", "cipher_suites"},
		"unknown section":     {"http_server_config:\n  http2: false\n", "http_server_config"},
		"plain password":      {"basic_auth_users:\n  u: hunter2\n", "bcrypt"},
		"colon in user":       {"basic_auth_users:\n  \"a:b\": " + good + "\n", "without ':'"},
		"no key file":         {"tls_server_config:\n  cert_file: s.crt\n", "key_file"},
		"missing cert":        {"tls_server_config:\n  cert_file: nope.crt\n  key_file: s.key\n", "nope.crt"},
		"old TLS":             {"tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  min_version: TLS10\n", "TLS12 or TLS13"},
		"bad client auth":     {"tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  client_auth_type: Sometimes\n", "client_auth_type"},
		"verify without CA":   {"tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  client_auth_type: RequireAndVerifyClientCert\n", "needs client_ca_file"},
		"CA without policy":   {"tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  client_ca_file: ca.crt\n  client_auth_type: NoClientCert\n", "NoClientCert"},
		"CA file not PEM":     {"tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  client_ca_file: s.key\n", "no PEM certificate"},
		"two documents":       {"basic_auth_users:\n  u: " + good + "\n---\nbasic_auth_users: {}\n", "one YAML document"},
		"not YAML":            {"tls_server_config: [", "yaml"},
		"wrong type of user":  {"basic_auth_users: [a, b]\n", "yaml"},
		"no users":            {"basic_auth_users: {}\n", "basic_auth_users lists no user"},
		"null users":          {"basic_auth_users:\n", "basic_auth_users lists no user"},
		"null TLS section":    {"tls_server_config:\n", "cert_file and key_file are both required"},
		"null users with TLS": {"tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\nbasic_auth_users: ~\n", "basic_auth_users lists no user"},
	} {
		path := writeFile(t, dir, strings.ReplaceAll(name, " ", "_")+".yml", []byte(tc.yaml))
		_, err := LoadWebConfig(path)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to mention %q", name, err, tc.want)
		}
	}
	if _, err := LoadWebConfig(filepath.Join(dir, "absent.yml")); err == nil {
		t.Error("missing file accepted")
	}
	// An empty file is a valid configuration: no TLS, no auth.
	c, err := LoadWebConfig(writeFile(t, dir, "empty.yml", nil))
	if err != nil || c.TLS() != nil || c.HasBasicAuth() {
		t.Fatalf("empty file: %v", err)
	}
}

// selfSigned returns a client certificate that signs itself (no CA).
func selfSigned(t *testing.T, cn string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(99),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// TestExportWebConfigClientAuthTypes runs every client_auth_type, with and
// without client_ca_file, through real TLS handshakes with a certificate of
// the client CA, a self-signed certificate and none. A configuration either
// verifies client certificates against client_ca_file or asks for none: one
// that would take an unverified certificate (RequestClientCert,
// RequireAnyClientCert: pgfence never looks at the certificate afterwards) or
// a client_ca_file it would not use is refused at start-up.
func TestExportWebConfigClientAuthTypes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	serverCA, clientCA := newTestCA(t, "server CA"), newTestCA(t, "client CA")
	crt, key := serverCA.issue(t, "exporter", x509.ExtKeyUsageServerAuth)
	writeFile(t, dir, "server.crt", crt)
	writeFile(t, dir, "server.key", key)
	writeFile(t, dir, "clients.crt", clientCA.pem)
	ccrt, ckey := clientCA.issue(t, "prometheus", x509.ExtKeyUsageClientAuth)
	signed, err := tls.X509KeyPair(ccrt, ckey)
	if err != nil {
		t.Fatal(err)
	}
	self := selfSigned(t, "prometheus")
	roots := x509.NewCertPool()
	roots.AddCert(serverCA.cert)

	const ok, refused = http.StatusOK, 0 // refused: the handshake fails
	type want struct{ signed, self, none int }
	for _, tc := range []struct {
		auth   string // "" leaves client_auth_type out
		ca     bool
		reject string // LoadWebConfig's error must mention it
		want   want
	}{
		{auth: "", ca: false, want: want{ok, ok, ok}}, // no client certificate is asked for
		{auth: "", ca: true, want: want{ok, refused, refused}},
		{auth: "NoClientCert", ca: false, want: want{ok, ok, ok}},
		{auth: "NoClientCert", ca: true, reject: "client_ca_file is set but client_auth_type is NoClientCert"},
		{auth: "RequestClientCert", ca: false, reject: "RequestClientCert takes any client certificate"},
		{auth: "RequestClientCert", ca: true, reject: "RequestClientCert takes any client certificate"},
		{auth: "RequireAnyClientCert", ca: false, reject: "RequireAnyClientCert takes any client certificate"},
		{auth: "RequireAnyClientCert", ca: true, reject: "RequireAnyClientCert takes any client certificate"},
		{auth: "VerifyClientCertIfGiven", ca: false, reject: "VerifyClientCertIfGiven needs client_ca_file"},
		{auth: "VerifyClientCertIfGiven", ca: true, want: want{ok, refused, ok}},
		{auth: "RequireAndVerifyClientCert", ca: false, reject: "RequireAndVerifyClientCert needs client_ca_file"},
		{auth: "RequireAndVerifyClientCert", ca: true, want: want{ok, refused, refused}},
	} {
		name := fmt.Sprintf("%s/ca=%v", tc.auth, tc.ca)
		yml := "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
		if tc.ca {
			yml += "  client_ca_file: clients.crt\n"
		}
		if tc.auth != "" {
			yml += "  client_auth_type: " + tc.auth + "\n"
		}
		c, err := LoadWebConfig(writeFile(t, dir, fmt.Sprintf("web-%s-%v.yml", tc.auth, tc.ca), []byte(yml)))
		if tc.reject != "" {
			if err == nil || !strings.Contains(err.Error(), tc.reject) {
				t.Errorf("%s: err = %v, want it refused mentioning %q", name, err, tc.reject)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		srv := serveTLS(t, c.TLS(), okHandler)
		for _, cl := range []struct {
			what  string
			certs []tls.Certificate
			want  int
		}{
			{"CA-signed certificate", []tls.Certificate{signed}, tc.want.signed},
			{"self-signed certificate", []tls.Certificate{self}, tc.want.self},
			{"no certificate", nil, tc.want.none},
		} {
			ccfg := &tls.Config{RootCAs: roots}
			if cl.certs != nil {
				// Sent whatever CAs the server names as acceptable (with
				// Certificates, Go's client would keep back a certificate of
				// another issuer, and the server would never see it).
				ccfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cl.certs[0], nil }
			}
			hc := &http.Client{Transport: &http.Transport{TLSClientConfig: ccfg}, Timeout: 30 * time.Second}
			resp, err := hc.Get(srv.URL)
			switch {
			case cl.want == refused && err == nil:
				resp.Body.Close()
				t.Errorf("%s, %s: status %d, want the handshake refused", name, cl.what, resp.StatusCode)
			case cl.want == refused && !strings.Contains(err.Error(), "tls: "):
				t.Errorf("%s, %s: %v, want a TLS alert", name, cl.what, err)
			case cl.want != refused && err != nil:
				t.Errorf("%s, %s: %v, want %d", name, cl.what, err, cl.want)
			case cl.want != refused:
				resp.Body.Close()
				if resp.StatusCode != cl.want {
					t.Errorf("%s, %s: status %d, want %d", name, cl.what, resp.StatusCode, cl.want)
				}
			}
		}
	}
}
