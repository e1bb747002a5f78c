package main

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"
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
