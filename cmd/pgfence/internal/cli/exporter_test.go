package cli

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"golang.org/x/crypto/bcrypt"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// lineWriter is a goroutine-safe buffer that reports the first line matching re.
type lineWriter struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	re    *regexp.Regexp
	found chan string
	once  sync.Once
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if m := w.re.FindStringSubmatch(w.buf.String()); m != nil {
		w.once.Do(func() { w.found <- m[1] })
	}
	return len(p), nil
}

func (w *lineWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// startExporter runs `pgfence exporter --listen 127.0.0.1:0 args...` in the
// background and returns its metrics URL; it is stopped (and must exit 0)
// when t ends.
func startExporter(t *testing.T, dsn string, args ...string) string {
	t.Helper()
	out := &lineWriter{re: regexp.MustCompile(`serving metrics on (https?://\S+)\n`), found: make(chan string, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() {
		done <- Main(ctx, append([]string{"exporter", "--listen", "127.0.0.1:0"}, args...), Env{
			Stdout: out, Stderr: out,
			Getenv: func(k string) string {
				if k == "DATABASE_URL" {
					return dsn
				}
				return ""
			},
		})
	}()
	var url string
	select {
	case url = <-out.found:
	case code := <-done:
		cancel()
		t.Fatalf("exporter exited with %d: %s", code, out.String())
	case <-time.After(60 * time.Second):
		cancel()
		t.Fatal("exporter did not start")
	}
	t.Cleanup(func() {
		cancel()
		select {
		case code := <-done:
			if code != 0 {
				t.Errorf("exporter exit %d: %s", code, out.String())
			}
		case <-time.After(30 * time.Second):
			t.Error("exporter did not stop on cancel")
		}
	})
	return url
}

func getMetrics(t *testing.T, c *http.Client, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, b)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// metric returns the value of name's series whose labels include labels
// (name, value pairs); ok is false if there is none.
func metric(fams map[string]*dto.MetricFamily, name string, labels ...string) (float64, bool) {
	f, ok := fams[name]
	if !ok {
		return 0, false
	}
next:
	for _, m := range f.Metric {
		have := map[string]string{}
		for _, lp := range m.Label {
			have[lp.GetName()] = lp.GetValue()
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if have[labels[i]] != labels[i+1] {
				continue next
			}
		}
		switch {
		case m.GetGauge() != nil:
			return m.GetGauge().GetValue(), true
		case m.GetCounter() != nil:
			return m.GetCounter().GetValue(), true
		}
		return m.GetUntyped().GetValue(), true
	}
	return 0, false
}

func TestExporterScrape(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.locks(name, token, holder, acquired_at, expires_at) VALUES
		('a', 4, 'h', now() - interval '20 seconds', now() + interval '1 minute'),
		('b', 11, 'h', now() - interval '2 minutes', now() - interval '90 seconds'),
		('c', 2, NULL, NULL, NULL), ('d', 1, NULL, NULL, NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.jobs(queue, state, run_at) VALUES
		('mail', 'available', now() - interval '30 seconds'), ('mail', 'available', now() + interval '1 hour');
		INSERT INTO pgfence.jobs(queue, state, holder, claim_token, claim_expires_at, attempts)
		VALUES ('mail', 'running', 'w1', 1, now() - interval '5 seconds', 1);
		INSERT INTO pgfence.jobs(queue, state, finished_at) VALUES ('mail', 'dead', now()), ('mail', 'completed', now())`); err != nil {
		t.Fatal(err)
	}

	url := startExporter(t, dsn)
	fams := getMetrics(t, http.DefaultClient, url)
	for _, c := range []struct {
		name   string
		labels []string
		lo, hi float64
	}{
		{"pgfence_up", nil, 1, 1},
		{"pgfence_locks", []string{"state", "held"}, 1, 1},
		{"pgfence_locks", []string{"state", "expired"}, 1, 1},
		{"pgfence_locks", []string{"state", "free"}, 2, 2},
		{"pgfence_lock_expired_seconds_max", nil, 89, 150},
		{"pgfence_lock_held_since_grant_seconds_max", nil, 19, 80},
		{"pgfence_lock_token_max", nil, 11, 11},
		{"pgfence_jobs", []string{"queue", "mail", "state", "available"}, 2, 2},
		{"pgfence_jobs", []string{"queue", "mail", "state", "running"}, 1, 1},
		{"pgfence_jobs_claim_expired_seconds_max", []string{"queue", "mail"}, 4, 60},
		{"pgfence_jobs_ready_age_seconds_max", []string{"queue", "mail"}, 29, 90},
		{"pgfence_jobs_expired_claims", []string{"queue", "mail"}, 1, 1},
		{"pgfence_jobs_dead_total", nil, 1, 1},
		{"pgfence_jobs_dead_by_queue_total", []string{"queue", "mail"}, 1, 1},
	} {
		v, ok := metric(fams, c.name, c.labels...)
		if !ok || v < c.lo || v > c.hi {
			t.Errorf("%s%v = %v (present %v), want %v..%v", c.name, c.labels, v, ok, c.lo, c.hi)
		}
	}
	if _, ok := metric(fams, "pgfence_jobs", "state", "completed"); ok {
		t.Error("completed jobs reported: the exporter must not count finished rows")
	}
}

// TestExporterBoundedFlags: --top-queues limits the queue labels and
// --cache-ttl 0 collects on every scrape.
func TestExporterBoundedFlags(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(context.Background(), `INSERT INTO pgfence.jobs(queue) SELECT 'q' || n FROM generate_series(1, 100) n`); err != nil {
		t.Fatal(err)
	}
	url := startExporter(t, dsn, "--top-queues", "3", "--cache-ttl", "0")
	fams := getMetrics(t, http.DefaultClient, url)
	queues := map[string]bool{}
	for _, m := range fams["pgfence_jobs"].GetMetric() {
		for _, lp := range m.Label {
			if lp.GetName() == "queue" {
				queues[lp.GetValue()] = true
			}
		}
	}
	if len(queues) != 4 || !queues["__other__"] {
		t.Fatalf("queue labels %v, want 3 and __other__", queues)
	}
	if v, _ := metric(fams, "pgfence_jobs", "queue", "__other__", "state", "available"); v != 97 {
		t.Fatalf("other = %v, want 97", v)
	}
	fams = getMetrics(t, http.DefaultClient, url)
	if v, _ := metric(fams, "pgfence_exporter_collections_total"); v != 2 {
		t.Fatalf("collections = %v after two scrapes with --cache-ttl 0", v)
	}
}

func TestExporterFlagErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	bad := filepath.Join(dir, "web.yml")
	if err := os.WriteFile(bad, []byte("basic_auth_users:\n  u: plaintext\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	noUsers := filepath.Join(dir, "no-users.yml")
	if err := os.WriteFile(noUsers, []byte("basic_auth_users: {}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	anyCert := filepath.Join(dir, "any-cert.yml")
	if err := os.WriteFile(anyCert, []byte("tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  client_auth_type: RequireAnyClientCert\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--top-queues", "0"}, "--top-queues"},
		{[]string{"--top-queues", "100000"}, "--top-queues"},
		{[]string{"--scrape-timeout", "0s"}, "--scrape-timeout"},
		{[]string{"--cache-ttl", "-1s"}, "--cache-ttl"},
		{[]string{"--max-waiting", "0"}, "--max-waiting"},
		{[]string{"--path", "metrics"}, "--path"},
		{[]string{"--web-config-file", filepath.Join(dir, "absent.yml")}, "absent.yml"},
		{[]string{"--web-config-file", bad}, "bcrypt"},
		{[]string{"--web-config-file", noUsers}, "basic_auth_users lists no user"},
		{[]string{"--web-config-file", anyCert}, "RequireAnyClientCert takes any client certificate"},
	} {
		// No database is needed: flags are checked first.
		r := run(t, "postgres://nobody@127.0.0.1:1/none", append([]string{"exporter"}, tc.args...)...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q", tc.args, r.code, r.stderr)
		}
	}
}

// TestExporterDefaultListen: the default port is not postgres_exporter's
// 9187, which often runs on the same host.
func TestExporterDefaultListen(t *testing.T) {
	t.Parallel()
	r := run(t, "", "exporter", "--help")
	if r.code != 0 || !strings.Contains(r.stdout, `"127.0.0.1:19187"`) {
		t.Fatalf("help: %d %s", r.code, r.stdout)
	}
	if _, port, _ := net.SplitHostPort(DefaultExporterListen); port == "9187" {
		t.Fatal("default port collides with postgres_exporter")
	}
}

// TestExporterWebConfig: --web-config-file serves over TLS and asks for
// basic auth.
func TestExporterWebConfig(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	dir := t.TempDir()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "pgfence exporter"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalECPrivateKey(key)
	hash, _ := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
	files := map[string][]byte{
		"tls.crt": pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		"tls.key": pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}),
		"web.yml": []byte("tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\nbasic_auth_users:\n  prometheus: " + string(hash) + "\n"),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	url := startExporter(t, dsn, "--web-config-file", filepath.Join(dir, "web.yml"))
	if !strings.HasPrefix(url, "https://") {
		t.Fatalf("url %s", url)
	}
	cert, _ := x509.ParseCertificate(der)
	roots := x509.NewCertPool()
	roots.AddCert(cert)
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}, Timeout: 30 * time.Second}

	resp, err := client.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("without credentials: %d", resp.StatusCode)
	}
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	req.SetBasicAuth("prometheus", "s3cret")
	resp, err = client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !bytes.Contains(body, []byte("pgfence_up 1")) {
		t.Fatalf("with credentials: %d %s", resp.StatusCode, body)
	}
	plain := strings.Replace(url, "https://", "http://", 1)
	if resp, err := http.Get(plain); err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("metrics served over plain HTTP")
		}
	}
}
