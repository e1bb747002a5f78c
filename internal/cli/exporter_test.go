package cli

import (
	"bytes"
	"context"
	"net/http"
	"regexp"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/pgfence/pgfence/internal/pgtest"
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
	var jobs bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass('pgfence.jobs') IS NOT NULL").Scan(&jobs); err != nil {
		t.Fatal(err)
	}
	if jobs {
		if _, err := pool.Exec(ctx, `INSERT INTO pgfence.jobs(queue, state, run_at) VALUES
			('mail', 'available', now() - interval '30 seconds'), ('mail', 'available', now() + interval '1 hour')`); err != nil {
			t.Fatal(err)
		}
	}

	out := &lineWriter{re: regexp.MustCompile(`serving metrics on (http://\S+)\n`), found: make(chan string, 1)}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan int, 1)
	go func() {
		done <- Main(rctx, []string{"exporter", "--listen", "127.0.0.1:0"}, Env{
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
		t.Fatalf("exporter exited with %d: %s", code, out.buf.String())
	case <-time.After(30 * time.Second):
		t.Fatal("exporter did not start")
	}

	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	get := func(name string, labels map[string]string) float64 {
		t.Helper()
		f, ok := fams[name]
		if !ok {
			t.Fatalf("metric %s missing", name)
		}
	next:
		for _, m := range f.Metric {
			for _, lp := range m.Label {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue next
				}
			}
			return gaugeValue(m)
		}
		t.Fatalf("metric %s%v missing", name, labels)
		return 0
	}
	if v := get("pgfence_up", nil); v != 1 {
		t.Errorf("pgfence_up = %v", v)
	}
	for state, want := range map[string]float64{"held": 1, "expired": 1, "free": 2} {
		if v := get("pgfence_locks", map[string]string{"state": state}); v != want {
			t.Errorf("pgfence_locks{state=%q} = %v, want %v", state, v, want)
		}
	}
	if v := get("pgfence_lock_expired_seconds_max", nil); v < 89 || v > 120 {
		t.Errorf("expired max = %v, want about 90", v)
	}
	if v := get("pgfence_lock_held_since_grant_seconds_max", nil); v < 19 || v > 50 {
		t.Errorf("held since grant = %v, want about 20", v)
	}
	if v := get("pgfence_lock_token_max", nil); v != 11 {
		t.Errorf("token max = %v", v)
	}
	if jobs {
		if v := get("pgfence_jobs", map[string]string{"queue": "mail", "state": "available"}); v != 2 {
			t.Errorf("jobs = %v", v)
		}
		if v := get("pgfence_jobs_ready_age_seconds_max", map[string]string{"queue": "mail"}); v < 29 || v > 60 {
			t.Errorf("ready age = %v", v)
		}
	}

	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exporter exit %d: %s", code, out.buf.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("exporter did not stop on cancel")
	}
}

func gaugeValue(m *dto.Metric) float64 {
	if g := m.GetGauge(); g != nil {
		return g.GetValue()
	}
	return m.GetUntyped().GetValue()
}
