package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestSummarize(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in             []float64
		med, low, high float64
	}{
		{[]float64{3, 1, 2}, 2, 1, 3},
		{[]float64{4, 1, 3, 2}, 2.5, 1, 4},
		{[]float64{7}, 7, 7, 7},
	} {
		m, lo, hi := summarize(tc.in)
		if m != tc.med || lo != tc.low || hi != tc.high {
			t.Errorf("summarize(%v) = %v, %v, %v; want %v, %v, %v", tc.in, m, lo, hi, tc.med, tc.low, tc.high)
		}
	}
	if m, _, _ := summarize(nil); !math.IsNaN(m) {
		t.Errorf("summarize(nil) median = %v, want NaN", m)
	}
}

func TestPairedRatios(t *testing.T) {
	t.Parallel()
	got := pairedRatios([]float64{10, 20, 30}, []float64{5, 10, 60})
	want := []float64{2, 2, 0.5}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("pairedRatios = %v, want %v", got, want)
		}
	}
	if got := pairedRatios([]float64{10, 30}, []float64{10, 20, 30}); len(got) != 1 || got[0] != 1 {
		t.Errorf("unequal lengths: got %v, want ratio of medians [1]", got)
	}
	if got := pairedRatios(nil, []float64{1}); got != nil {
		t.Errorf("missing numerator: got %v, want nil", got)
	}
}

func TestFormatNum(t *testing.T) {
	t.Parallel()
	for v, want := range map[float64]string{12345.6: "12346", 456.7: "457", 12.34: "12.3", 1.234: "1.23", 0.1234: "0.123"} {
		if got := formatNum(v); got != want {
			t.Errorf("formatNum(%v) = %q, want %q", v, got, want)
		}
	}
	if got := formatNum(math.NaN()); got != "—" {
		t.Errorf("formatNum(NaN) = %q", got)
	}
}

func sampleRows() []Row {
	l0 := newRow("L0 UPDATE limit", "random row", 8, "ops/s", []float64{1000, 1200, 1100})
	b1 := newRow("B1", "a|b", 8, "cycles/s", []float64{300, 320, 310}).withRatio(0.85, "B1 ÷ (L0 ÷ 3)", 0.9)
	return []Row{l0, b1, notMeasured("B5 takeover", "", 0, "ms", "pglock not merged yet")}
}

func TestWriteMarkdown(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	if err := WriteMarkdown(&buf, sampleRows()); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 5 {
		t.Fatalf("got %d lines, want header, separator and 3 rows:\n%s", len(lines), buf.String())
	}
	for i, l := range lines {
		// Every line has the same number of unescaped cell separators.
		if n := strings.Count(strings.ReplaceAll(l, `\|`, ""), "|"); n != len(header)+1 {
			t.Errorf("line %d has %d separators, want %d: %q", i, n, len(header)+1, l)
		}
	}
	for _, want := range []string{
		"| L0 UPDATE limit | random row | 8 | ops/s | 1100 | 1000–1200 |  |  |",
		`a\|b`,
		"0.850 (B1 ÷ (L0 ÷ 3)) | ≥ 0.9: NOT met |",
		"not measured: pglock not merged yet",
	} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("markdown lacks %q:\n%s", want, buf.String())
		}
	}
}

func TestWriteText(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	if err := WriteText(&buf, sampleRows()); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 4 || !strings.HasPrefix(lines[0], "Scenario") {
		t.Fatalf("unexpected text table:\n%s", buf.String())
	}
	// Columns are aligned: "Variant" starts at the same offset as the row's variant.
	col := strings.Index(lines[0], "Variant")
	if got := strings.Index(lines[1], "random row"); got != col {
		t.Errorf("variant column at %d, header at %d:\n%s", got, col, buf.String())
	}
}

func TestWriteJSON(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	rep := Report{Date: "2026-11-29T10:00:00Z", Reps: 3, Rows: sampleRows(),
		Goals: []Goal{{Name: "B3", Target: "≥ 0.95", Value: "0.99", Status: "met"}}}
	if err := WriteJSON(&buf, rep); err != nil {
		t.Fatal(err)
	}
	var got struct {
		Rows []struct {
			Scenario string   `json:"scenario"`
			Median   *float64 `json:"median"`
			Ratio    *float64 `json:"ratio"`
			GoalMet  *bool    `json:"goal_met"`
			Note     string   `json:"note"`
		} `json:"rows"`
		Goals []Goal `json:"goals"`
	}
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("invalid JSON: %v\n%s", err, buf.String())
	}
	if len(got.Rows) != 3 || len(got.Goals) != 1 {
		t.Fatalf("got %d rows, %d goals", len(got.Rows), len(got.Goals))
	}
	if got.Rows[0].Median == nil || *got.Rows[0].Median != 1100 {
		t.Errorf("row 0 median = %v, want 1100", got.Rows[0].Median)
	}
	if got.Rows[1].Ratio == nil || *got.Rows[1].Ratio != 0.85 || got.Rows[1].GoalMet == nil || *got.Rows[1].GoalMet {
		t.Errorf("row 1 ratio/goal wrong: %+v", got.Rows[1])
	}
	if got.Rows[2].Median != nil || !strings.HasPrefix(got.Rows[2].Note, "not measured") {
		t.Errorf("not-measured row should have null median and a note: %+v", got.Rows[2])
	}
}

func TestGoalCheck(t *testing.T) {
	t.Parallel()
	g := goalCheck{name: "x", target: "≥ 1"}
	if s := g.goal().Status; s != "not measured" {
		t.Errorf("empty goal status = %q", s)
	}
	g.addRatio("c=1", newRow("R", "", 1, "ratio", []float64{1.2}).withRatio(1.2, "", 1))
	g.addRatio("c=8", newRow("R", "", 8, "ratio", []float64{0.8}).withRatio(0.8, "", 1))
	if s := g.goal().Status; s != "partly met (1 of 2)" {
		t.Errorf("status = %q", s)
	}
}

func TestWriteChart(t *testing.T) {
	t.Parallel()
	path := t.TempDir() + "/chart.png"
	rows := []Row{
		newRow("L0 UPDATE limit", "random row", 1, "ops/s", []float64{400}),
		newRow("L0 UPDATE limit", "random row", 8, "ops/s", []float64{3000}),
		newRow("P1 etcd Mutex Lock+Unlock", "distinct keys", 8, "cycles/s", []float64{1000}),
	}
	if err := writeChart(path, rows, []int{1, 8, 32}); err != nil {
		t.Fatal(err)
	}
	if err := writeChart(path, nil, []int{1}); err == nil {
		t.Error("chart of no rows: want an error")
	}
}

func TestSortRows(t *testing.T) {
	t.Parallel()
	rows := []Row{{Scenario: "P1 etcd", Variant: "a"}, {Scenario: "M memory"}, {Scenario: "L0 UPDATE limit"},
		{Scenario: "P1 etcd", Variant: "b"}, {Scenario: "B2 handoff"}, {Scenario: "R ratio"}}
	sortRows(rows)
	var got []string
	for _, r := range rows {
		got = append(got, r.Scenario+r.Variant)
	}
	want := "L0 UPDATE limit,B2 handoff,P1 etcda,P1 etcdb,R ratio,M memory"
	if strings.Join(got, ",") != want {
		t.Errorf("order = %v, want %s", got, want)
	}
}

func TestJainIndex(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   []float64
		want float64
	}{
		{[]float64{5, 5, 5, 5}, 1},
		{[]float64{8, 0, 0, 0}, 0.25}, // one client got everything: 1/n
		{[]float64{1, 3}, 16.0 / 20},  // (1+3)² / (2·(1+9))
	} {
		if got := jainIndex(tc.in); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("jainIndex(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
	if got := jainIndex([]float64{0, 0}); !math.IsNaN(got) {
		t.Errorf("jainIndex of no grants = %v, want NaN", got)
	}
}

// TestLockProbeSafety drives the probe through a correct handoff, an
// overlapping grant and a token that went backwards, and checks what it
// counted.
func TestLockProbeSafety(t *testing.T) {
	t.Parallel()
	p := newLockProbe("B2 x", "v", 2, 1, true, false)
	r := p.start()
	r.granted(0, 0, 10, r.begin())
	r.releasing(0, 0)
	r.granted(1, 0, 11, r.begin())
	r.releasing(1, 0)
	p.finish(true, true)
	if !p.safety.OK() || p.safety.Grants != 2 || p.safety.Runs != 1 {
		t.Fatalf("clean handoff: %+v", p.safety)
	}
	// A second run: tokens are compared across runs of the variant.
	r = p.start()
	r.granted(0, 0, 12, r.begin())
	r.granted(1, 0, 13, r.begin()) // client 0 has not released: a violation
	r.releasing(0, 0)
	r.releasing(1, 0)
	r.granted(0, 0, 13, r.begin()) // not greater than 13: a regression
	r.releasing(0, 0)
	p.finish(false, true)
	if p.safety.Violations != 1 || p.safety.Regressions != 1 || p.safety.Grants != 5 || p.safety.Runs != 2 {
		t.Fatalf("want 1 violation and 1 regression in 5 grants over 2 runs: %+v", p.safety)
	}
	// Without tokens only mutual exclusion is checked.
	q := newLockProbe("P3 x", "v", 1, 1, false, false)
	r = q.start()
	r.granted(0, 0, noToken, r.begin())
	r.releasing(0, 0)
	r.granted(0, 0, noToken, r.begin())
	q.finish(true, true)
	if !q.safety.OK() || q.safety.Grants != 2 {
		t.Fatalf("token-less lock: %+v", q.safety)
	}
}

// TestLockProbeContention replays a known grant order on a hot name and
// checks the bypass counts, the fairness index, and that each client's first
// acquire of the run (the arrival) is counted apart from the later waits.
func TestLockProbeContention(t *testing.T) {
	t.Parallel()
	p := newLockProbe("B2 x", "v", 3, 1, true, true)
	r := p.start()
	s1 := r.begin()                 // client 1 starts waiting before any grant
	s2 := r.begin()                 // so does client 2
	s1.at = s1.at.Add(-time.Second) // and has been waiting a second
	tok := int64(0)
	grant := func(w int, s acquireStart) {
		tok++
		r.granted(w, 0, tok, s)
		r.releasing(w, 0)
	}
	// Client 0 takes the lock three times while 1 and 2 wait, then they get it.
	for range 3 {
		grant(0, r.begin())
	}
	grant(1, s1) // 3 grants went to others while client 1 waited
	grant(2, s2) // 4 while client 2 waited
	p.finish(true, true)
	c := p.cont
	if len(c.bypassMax) != 1 || c.bypassMax[0] != 4 {
		t.Errorf("bypass max = %v, want [4]", c.bypassMax)
	}
	// Grants per client 3, 1, 1: (5)² / (3 · 11).
	if want := 25.0 / 33; len(c.fairness) != 1 || math.Abs(c.fairness[0]-want) > 1e-12 {
		t.Errorf("fairness = %v, want %v", c.fairness, want)
	}
	if !p.safety.OK() || p.safety.Grants != 5 {
		t.Errorf("safety: %+v", p.safety)
	}
	// Client 1's one-second wait is its arrival: in the arrival row, not in
	// the waits (client 0's second and third acquires, each at once).
	if len(c.arrivalMax) != 1 || c.arrivalMax[0] < 1000 {
		t.Errorf("first acquire wait max = %v ms, want ≥ 1000", c.arrivalMax)
	}
	if len(c.waitMax) != 1 || c.waitMax[0] >= 1000 {
		t.Errorf("acquire wait max = %v ms, want client 0's later waits only (< 1000)", c.waitMax)
	}
	if n := len(r.workers[0].waits) + len(r.workers[1].waits) + len(r.workers[2].waits); n != 2 {
		t.Errorf("%d waits recorded, want 2 (every acquire but the first of each client)", n)
	}
	// A warm-up (not timed) adds no contention figures.
	r = p.start()
	r.granted(0, 0, tok+1, r.begin())
	r.releasing(0, 0)
	p.finish(false, true)
	if len(p.cont.fairness) != 1 {
		t.Errorf("warm-up added contention figures: %v", p.cont.fairness)
	}
}

func TestWriteSafety(t *testing.T) {
	t.Parallel()
	cs := []SafetyCount{
		{Scenario: "B2 contended handoff, one name", Variant: "LISTEN/NOTIFY", Clients: 8, Runs: 4, Grants: 1234, Tokens: true},
		{Scenario: scenP3, Variant: "one hot key", Clients: 8, Runs: 4, Grants: 99, Violations: 2},
	}
	var buf bytes.Buffer
	if err := WriteSafety(&buf, cs); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| Scenario | Variant | Clients | Runs | Grants checked | Mutual-exclusion violations | Token regressions |",
		"| B2 contended handoff, one name | LISTEN/NOTIFY | 8 | 4 | 1234 | 0 | 0 |",
		"| 8 | 4 | 99 | 2 | n/a (no token) |",
	} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("safety table lacks %q:\n%s", want, buf.String())
		}
	}
	if runs, grants, v, r := safetyTotals(cs); runs != 8 || grants != 1333 || v != 2 || r != 0 {
		t.Errorf("totals = %d, %d, %d, %d", runs, grants, v, r)
	}
	if cs[0].OK() == false || cs[1].OK() {
		t.Errorf("OK() wrong: %v %v", cs[0].OK(), cs[1].OK())
	}
	// JSON carries the counters under stable names.
	buf.Reset()
	if err := WriteJSON(&buf, Report{Rows: sampleRows(), Safety: cs}); err != nil {
		t.Fatal(err)
	}
	var got struct {
		Safety []map[string]any `json:"safety"`
	}
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Safety) != 2 || got.Safety[1]["mutual_exclusion_violations"] != 2.0 ||
		got.Safety[0]["token_regressions"] != 0.0 || got.Safety[0]["grants_checked"] != 1234.0 {
		t.Errorf("safety JSON = %v", got.Safety)
	}
}

func TestContentionRowsGoals(t *testing.T) {
	t.Parallel()
	b := &bench{}
	c := &contentionSeries{
		waitP50: []float64{1}, waitP99: []float64{10}, waitMax: []float64{20},
		fairness: []float64{0.95}, bypassP99: []float64{5}, bypassMax: []float64{20},
		gapMean: []float64{1}, waitP99PerNGap: []float64{1.25},
	}
	rows := b.addContentionRows("B2 x", keyB2Listen, 8, c, true)
	met := map[string]bool{}
	for _, r := range rows {
		if r.GoalMet != nil {
			met[r.Metric] = *r.GoalMet
		}
	}
	want := map[string]bool{
		"fairness index": true,
		"acquire wait p99 ÷ (N × mean grant interval)":     true,
		"bypass max (grants to others during one acquire)": false, // 20 > 2 × 7 waiters
	}
	for m, w := range want {
		if got, ok := met[m]; !ok || got != w {
			t.Errorf("%s: goal met = %v (present %v), want %v", m, got, ok, w)
		}
	}
	b.b2ContentionGoals(8, rows)
	if len(b.b2Goals) != 3 {
		t.Fatalf("got %d B2 goals, want 3", len(b.b2Goals))
	}
	for _, g := range b.b2Goals {
		if g.metric == "bypass max (grants to others during one acquire)" && g.goal().Status != "NOT met" {
			t.Errorf("bypass goal: %+v", g.goal())
		}
	}
}

// TestLockProbeCatchesOverlap runs two clients through closedLoop with a
// "lock" that grants both at once on their first operation, and checks that
// the registry counts it while later clean cycles add nothing.
func TestLockProbeCatchesOverlap(t *testing.T) {
	t.Parallel()
	p := newLockProbe("B2 x", "broken", 2, 1, true, true)
	r := p.start()
	var tok atomic.Int64
	first, second, third := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var mu sync.Mutex // a correct lock for the later operations
	// The run ends once each client did two correctly locked operations
	// after the first (the contention figures leave out first acquires),
	// however long a loaded machine takes to get there.
	ctx, stop := context.WithTimeout(context.Background(), time.Minute)
	defer stop()
	var later [2]atomic.Int64
	_, err := closedLoop(ctx, 2, time.Minute, func(ctx context.Context, w, i int) error {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if i > 0 && later[w].Add(1) > 2 && later[1-w].Load() > 2 {
			stop()
			return context.Canceled
		}
		st := r.begin()
		if i == 0 {
			// Client 0 is granted and holds on until client 1 was granted too.
			if w == 1 {
				<-first
			}
			r.granted(w, 0, tok.Add(1), st)
			if w == 0 {
				close(first)
				<-second
				r.releasing(w, 0)
				close(third)
			} else {
				close(second)
				<-third // the later, correctly locked operations start once both let go
				r.releasing(w, 0)
			}
			return nil
		}
		mu.Lock()
		r.granted(w, 0, tok.Add(1), st)
		r.releasing(w, 0)
		mu.Unlock()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	p.finish(true, true)
	if p.safety.Violations != 1 || p.safety.Regressions != 0 || p.safety.Grants < 6 {
		t.Errorf("want exactly 1 violation, 0 regressions: %+v", p.safety)
	}
	if len(p.cont.fairness) != 1 {
		t.Errorf("no contention figures: %+v", p.cont)
	}
}
