package deploycheck

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.yaml.in/yaml/v3"

	"github.com/pgfence/pgfence/cmd/pgfence/internal/exporter"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/observe"
	"github.com/pgfence/pgfence/observe/promobserve"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The files checked, relative to this package's directory (the repository's
// deploy/ and docs/).
const (
	promDir        = "../../../../deploy/prometheus"
	alertsFile     = promDir + "/pgfence-alerts.yml"
	alertTestsFile = promDir + "/pgfence-alerts_test.yml"
	dashboardFile  = "../../../../deploy/grafana/pgfence-dashboard.json"
	guideFile      = "../../../../docs/observability.md"
)

// promtool returns the path of promtool, or fails the test saying how to get
// it: these checks are never skipped.
func promtool(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("promtool"); err == nil {
		return p
	}
	t.Fatal("promtool not found: install the Debian package prometheus (promtool) or run make test-deps")
	return ""
}

// run runs promtool with args in dir (stdin from stdin if not nil) and fails
// the test with its output when it exits non-zero.
func run(t *testing.T, dir string, stdin []byte, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, promtool(t), args...)
	cmd.Dir = dir
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestPromtoolRules: the rules load in Prometheus's own checker, and every
// unit test of pgfence-alerts_test.yml passes.
func TestPromtoolRules(t *testing.T) {
	t.Parallel()
	out := run(t, promDir, nil, "check", "rules", filepath.Base(alertsFile))
	if !strings.Contains(out, "SUCCESS") {
		t.Fatalf("promtool check rules:\n%s", out)
	}
	out = run(t, promDir, nil, "test", "rules", filepath.Base(alertTestsFile))
	if !strings.Contains(out, "SUCCESS") || strings.Contains(out, "FAILED") {
		t.Fatalf("promtool test rules:\n%s", out)
	}
}

// known is a series name that pgfence serves.
type known struct {
	kind   string // counter, gauge, bucket, sum, count
	labels []string
}

// catalog maps every series name pgfence's metrics appear under in the
// Prometheus exposition to its kind and labels: observe.Catalog (histograms as
// _bucket, _sum and _count series) and the exporter's catalog.
func catalog(t *testing.T) map[string]known {
	t.Helper()
	out := map[string]known{}
	add := func(name string, k known) {
		if _, dup := out[name]; dup {
			t.Fatalf("metric %s defined twice", name)
		}
		out[name] = k
	}
	for _, d := range observe.Catalog {
		switch d.Kind {
		case observe.Counter:
			add(d.Name, known{"counter", d.Labels})
		case observe.Histogram:
			add(d.Name+"_bucket", known{"bucket", append(slices.Clone(d.Labels), "le")})
			add(d.Name+"_sum", known{"sum", d.Labels})
			add(d.Name+"_count", known{"count", d.Labels})
		}
	}
	for _, d := range exporter.Catalog {
		add(d.Name, known{d.Type, d.Labels})
	}
	return out
}

// targetLabels are attached by Prometheus to every scraped series.
var targetLabels = []string{"job", "instance"}

// checkExpr parses expr and returns its problems: unknown metrics, labels a
// metric does not have, counters read without rate()/increase(), gauges and
// bucket series read through them. It returns the metric names found.
func checkExpr(cat map[string]known, expr string) ([]string, []error) {
	p, err := parsePromQL(expr)
	if err != nil {
		return nil, []error{err}
	}
	var errs []error
	var names []string
	exprLabels := slices.Clone(targetLabels)
	for _, u := range p.metrics {
		k, ok := cat[u.name]
		if !ok {
			errs = append(errs, fmt.Errorf("unknown metric %s", u.name))
			continue
		}
		names = append(names, u.name)
		exprLabels = append(exprLabels, k.labels...)
		for _, l := range u.labels {
			if !slices.Contains(k.labels, l) && !slices.Contains(targetLabels, l) {
				errs = append(errs, fmt.Errorf("%s has no label %s", u.name, l))
			}
		}
		overTime := u.fn == "rate" || u.fn == "irate" || u.fn == "increase"
		switch {
		case k.kind == "counter" && !overTime:
			errs = append(errs, fmt.Errorf("counter %s read as a value (in %q): use rate() or increase()", u.name, u.fn))
		case k.kind == "gauge" && overTime:
			errs = append(errs, fmt.Errorf("gauge %s read through %s()", u.name, u.fn))
		case (k.kind == "bucket" || k.kind == "sum" || k.kind == "count") && !overTime:
			errs = append(errs, fmt.Errorf("histogram series %s read as a value: use rate()", u.name))
		}
	}
	for _, l := range p.grouping {
		if !slices.Contains(exprLabels, l) {
			errs = append(errs, fmt.Errorf("grouping label %s is on none of the metrics", l))
		}
	}
	if len(p.metrics) == 0 {
		errs = append(errs, errors.New("no metric"))
	}
	return names, errs
}

func TestCheckExprCatchesMistakes(t *testing.T) {
	t.Parallel()
	cat := catalog(t)
	good := []string{
		`sum by (table, reason) (rate(pgfence_fenced_write_refused_total{reason="stale"}[5m])) > 0.1`,
		`histogram_quantile(0.99, sum by (le, outcome) (rate(pgfence_lease_acquire_seconds_bucket[5m])))`,
		`increase(pgfence_jobs_dead_total[1h]) > 0`,
		`max by (queue) (pgfence_jobs_ready_age_seconds_max{queue=~"$queue"}) > 600`,
		`sum(rate(pgfence_rows_claimed_total[5m])) by (queue)`,
		`pgfence_lock_token_max > 9e18`,
	}
	for _, e := range good {
		if _, errs := checkExpr(cat, e); len(errs) > 0 {
			t.Errorf("%s: %v", e, errs)
		}
	}
	bad := map[string]string{
		`increase(pgfence_jobs{state="dead"}[1h]) > 0`:                          "gauge pgfence_jobs read through increase()",
		`pgfence_jobs_dead_total > 0`:                                           "counter pgfence_jobs_dead_total read as a value",
		`rate(pgfence_fenced_write_rejected_total[5m])`:                         "unknown metric pgfence_fenced_write_rejected_total",
		`sum by (table) (rate(pgfence_leases_lost_total[5m]))`:                  "grouping label table is on none of the metrics",
		`rate(pgfence_fenced_writes_total{reason="stale"}[5m])`:                 "pgfence_fenced_writes_total has no label reason",
		`histogram_quantile(0.99, rate(pgfence_lease_acquire_seconds[5m]))`:     "unknown metric pgfence_lease_acquire_seconds",
		`sum(pgfence_claim_seconds_count)`:                                      "histogram series pgfence_claim_seconds_count read as a value",
		`rate(pgfence_rows_claimed_total[5m]`:                                   "unbalanced ( in",
		`sum_rate(pgfence_rows_claimed_total[5m])`:                              "unknown function sum_rate",
		`sum by (queue) (increase(pgfence_claims_lost_totl[15m])) > 0`:          "unknown metric pgfence_claims_lost_totl",
		`max(pgfence_jobs_claim_expired_seconds_max{queu="mail"}) > 120`:        "has no label queu",
		`sum without (state) (pgfence_locks) unless on (instanc) pgfence_up`:    "grouping label instanc",
		`sum by (queue) (rate(pgfence_outbox_deliveries_total{topic="a"}[5m]))`: "grouping label queue",
	}
	for e, want := range bad {
		_, errs := checkExpr(cat, e)
		if !strings.Contains(fmt.Sprint(errs), want) {
			t.Errorf("%s: errors %v, want %q", e, errs, want)
		}
	}
}

// rules is the part of a Prometheus rules file the checks read.
type rules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Record      string            `yaml:"record"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// ruleTests is the part of a promtool test file the checks read.
type ruleTests struct {
	RuleFiles []string `yaml:"rule_files"`
	Tests     []struct {
		Name      string `yaml:"name"`
		AlertTest []struct {
			EvalTime  string `yaml:"eval_time"`
			Alertname string `yaml:"alertname"`
			ExpAlerts []any  `yaml:"exp_alerts"`
		} `yaml:"alert_rule_test"`
	} `yaml:"tests"`
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// TestAlertRules: every alert uses only metrics and labels pgfence serves,
// reads counters through increase()/rate(), has a severity, a summary and a
// description, and has unit tests where it fires and where it stays silent.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	cat := catalog(t)
	var rs rules
	readYAML(t, alertsFile, &rs)
	alerts := map[string]bool{}
	for _, g := range rs.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				t.Errorf("group %s: a rule without alert name (recording rules are not shipped)", g.Name)
				continue
			}
			if alerts[r.Alert] {
				t.Errorf("alert %s defined twice", r.Alert)
			}
			alerts[r.Alert] = true
			if _, errs := checkExpr(cat, r.Expr); len(errs) > 0 {
				t.Errorf("alert %s: %q: %v", r.Alert, r.Expr, errs)
			}
			if s := r.Labels["severity"]; s != "info" && s != "warning" && s != "critical" {
				t.Errorf("alert %s: severity %q", r.Alert, s)
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("alert %s: summary or description missing", r.Alert)
			}
		}
	}
	if len(alerts) == 0 {
		t.Fatal("no alerts")
	}
	var ts ruleTests
	readYAML(t, alertTestsFile, &ts)
	if !slices.Equal(ts.RuleFiles, []string{filepath.Base(alertsFile)}) {
		t.Errorf("rule_files = %v", ts.RuleFiles)
	}
	fires, silent := map[string]bool{}, map[string]bool{}
	for _, tc := range ts.Tests {
		for _, a := range tc.AlertTest {
			if !alerts[a.Alertname] {
				t.Errorf("test %q: unknown alert %s", tc.Name, a.Alertname)
			}
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				silent[a.Alertname] = true
			}
		}
	}
	for a := range alerts {
		if !fires[a] || !silent[a] {
			t.Errorf("alert %s: tested firing %v, tested silent %v; want both", a, fires[a], silent[a])
		}
	}
}

// dashboard is the part of a Grafana dashboard the checks read.
type dashboard struct {
	UID        string  `json:"uid"`
	Title      string  `json:"title"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	} `json:"datasource"`
	GridPos struct{ H, W, X, Y int } `json:"gridPos"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // of a collapsed row
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// grafanaVars are the dashboard's variables, replaced as Grafana would.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "6h")

// panels returns every panel, rows' nested panels included.
func (d dashboard) panels() []panel {
	var out []panel
	for _, p := range d.Panels {
		out = append(out, p)
		out = append(out, p.Panels...)
	}
	return out
}

// TestDashboard: the dashboard has a Prometheus data-source variable that
// every query uses, its panels do not overlap, every expression uses only
// metrics and labels pgfence serves (counters through rate()/increase()), and
// every metric of both catalogs is on some panel.
func TestDashboard(t *testing.T) {
	t.Parallel()
	cat := catalog(t)
	d := readDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Errorf("uid %q title %q", d.UID, d.Title)
	}
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		switch v.Type {
		case "datasource":
			var q string
			if err := json.Unmarshal(v.Query, &q); err != nil || q != "prometheus" {
				t.Errorf("variable %s: data source query %s, want \"prometheus\"", v.Name, v.Query)
			}
		case "query":
			var q struct{ Query string }
			if err := json.Unmarshal(v.Query, &q); err != nil {
				t.Errorf("variable %s: %v", v.Name, err)
			}
			m := regexp.MustCompile(`^label_values\((\w+),\s*(\w+)\)$`).FindStringSubmatch(q.Query)
			if m == nil {
				t.Errorf("variable %s: query %q, want label_values(metric, label)", v.Name, q.Query)
			} else if k, ok := cat[m[1]]; !ok || !slices.Contains(k.labels, m[2]) {
				t.Errorf("variable %s: %s has no label %s", v.Name, m[1], m[2])
			}
		}
	}
	if !vars["datasource"] {
		t.Fatal("no datasource variable")
	}
	used := map[string]bool{}
	ids := map[int]bool{}
	type cell struct{ x, y int }
	taken := map[cell]int{}
	for _, p := range d.panels() {
		if ids[p.ID] || p.ID == 0 {
			t.Errorf("panel %q: id %d not unique", p.Title, p.ID)
		}
		ids[p.ID] = true
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q: gridPos %+v", p.Title, g)
		}
		for x := g.X; x < g.X+g.W; x++ {
			for y := g.Y; y < g.Y+g.H; y++ {
				if other, ok := taken[cell{x, y}]; ok {
					t.Fatalf("panel %q overlaps panel %d at (%d, %d)", p.Title, other, x, y)
				}
				taken[cell{x, y}] = p.ID
			}
		}
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.Type != "prometheus" || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q: datasource %+v, want the ${datasource} variable", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q: no query", p.Title)
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			if tg.RefID == "" || refs[tg.RefID] {
				t.Errorf("panel %q: refId %q missing or repeated", p.Title, tg.RefID)
			}
			refs[tg.RefID] = true
			names, errs := checkExpr(cat, grafanaVars.Replace(tg.Expr))
			if len(errs) > 0 {
				t.Errorf("panel %q, query %s: %q: %v", p.Title, tg.RefID, tg.Expr, errs)
			}
			for _, n := range names {
				used[strings.TrimSuffix(n, "_bucket")] = true
			}
		}
	}
	for _, d := range observe.Catalog {
		if !used[d.Name] {
			t.Errorf("%s is on no panel", d.Name)
		}
	}
	for _, d := range exporter.Catalog {
		if !used[d.Name] {
			t.Errorf("%s is on no panel", d.Name)
		}
	}
}

// TestPromQLSyntax hands every dashboard query to promtool's PromQL parser,
// as recording rules in a temporary rules file.
func TestPromQLSyntax(t *testing.T) {
	t.Parallel()
	d := readDashboard(t)
	var b strings.Builder
	b.WriteString("groups:\n  - name: pgfence-dashboard\n    rules:\n")
	n := 0
	for _, p := range d.panels() {
		for _, tg := range p.Targets {
			n++
			expr, _ := json.Marshal(grafanaVars.Replace(strings.ReplaceAll(tg.Expr, "$queue", ".*")))
			fmt.Fprintf(&b, "      - record: pgfence:dashboard_panel%d_%s\n        expr: %s\n", p.ID, strings.ToLower(tg.RefID), expr)
		}
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "dashboard.yml"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	out := run(t, dir, nil, "check", "rules", "dashboard.yml")
	if want := fmt.Sprintf("SUCCESS: %d rules found", n); !strings.Contains(out, want) {
		t.Fatalf("promtool check rules on the dashboard's %d queries:\n%s", n, out)
	}
}

// TestMetricsLint runs promtool check metrics (Prometheus's naming and help
// conventions) over what promobserve and the exporter serve.
func TestMetricsLint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range observe.Catalog {
		lv := make([]string, len(d.Labels))
		for i := range lv {
			lv[i] = "x"
		}
		if d.Kind == observe.Counter {
			m.Add(ctx, d.Name, 1, lv...)
		} else {
			m.Observe(ctx, d.Name, 0.01, lv...)
		}
	}
	client := scrapeBody(t, promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	lint(t, "promobserve", client)

	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.locks(name, token, holder, acquired_at, expires_at) VALUES ('a', 1, 'h', now(), now() + interval '1 minute');
		INSERT INTO pgfence.jobs(queue) VALUES ('q'); INSERT INTO pgfence.jobs(queue, state, finished_at) VALUES ('q', 'dead', now())`); err != nil {
		t.Fatal(err)
	}
	e, err := exporter.New(pool, exporter.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	db := scrapeBody(t, e)
	for _, d := range exporter.Catalog {
		if !bytes.Contains(db, []byte("\n# TYPE "+d.Name+" ")) {
			t.Errorf("exporter scrape lacks %s:\n%s", d.Name, db)
		}
	}
	lint(t, "exporter", db)
}

func scrapeBody(t *testing.T, h http.Handler) []byte {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("scrape: %d %s", rec.Code, rec.Body)
	}
	return append([]byte("\n"), rec.Body.Bytes()...)
}

// lint fails on any promtool check metrics finding.
func lint(t *testing.T, what string, body []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, promtool(t), "check", "metrics")
	cmd.Stdin = bytes.NewReader(bytes.TrimPrefix(body, []byte("\n")))
	out, err := cmd.CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("promtool check metrics on %s's exposition: %v\n%s", what, err, out)
	}
}

// TestGuideExplainsEverything: docs/observability.md names every alert and
// every metric of both catalogs.
func TestGuideExplainsEverything(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(guideFile)
	if err != nil {
		t.Fatal(err)
	}
	guide := string(b)
	var missing []string
	var rs rules
	readYAML(t, alertsFile, &rs)
	for _, g := range rs.Groups {
		for _, r := range g.Rules {
			if !strings.Contains(guide, "`"+r.Alert+"`") {
				missing = append(missing, "alert "+r.Alert)
			}
		}
	}
	for _, d := range observe.Catalog {
		if !strings.Contains(guide, "`"+d.Name+"`") {
			missing = append(missing, d.Name)
		}
	}
	for _, d := range exporter.Catalog {
		if !strings.Contains(guide, "`"+d.Name) {
			missing = append(missing, d.Name)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("%s does not name: %s", guideFile, strings.Join(missing, ", "))
	}
}
