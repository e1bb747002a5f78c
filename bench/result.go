package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// Row is one line of the results table. A row either carries samples (one per
// repetition) or a Note saying why it was not measured.
type Row struct {
	Scenario string    `json:"scenario"`
	Variant  string    `json:"variant"`
	Clients  int       `json:"clients,omitempty"` // 0: not applicable
	Metric   string    `json:"metric"`
	Samples  []float64 `json:"samples,omitempty"`
	Median   float64   `json:"median"`
	Min      float64   `json:"min"`
	Max      float64   `json:"max"`
	// Ratio is set for rows defined as a ratio; RatioDef says of what.
	Ratio    *float64 `json:"ratio,omitempty"`
	RatioDef string   `json:"ratio_def,omitempty"`
	// Goal is a target for the ratio (or value), GoalMet whether it was reached.
	Goal    string `json:"goal,omitempty"`
	GoalMet *bool  `json:"goal_met,omitempty"`
	Note    string `json:"note,omitempty"`
}

// Measured reports whether the row has at least one sample.
func (r Row) Measured() bool { return len(r.Samples) > 0 }

// newRow summarises samples into a row.
func newRow(scenario, variant string, clients int, metric string, samples []float64) Row {
	r := Row{Scenario: scenario, Variant: variant, Clients: clients, Metric: metric}
	r.Samples = slices.Clone(samples)
	r.Median, r.Min, r.Max = summarize(samples)
	return r
}

// notMeasured returns a row that says why a scenario has no number.
func notMeasured(scenario, variant string, clients int, metric, why string) Row {
	nan := math.NaN()
	return Row{Scenario: scenario, Variant: variant, Clients: clients, Metric: metric,
		Median: nan, Min: nan, Max: nan, Note: "not measured: " + why}
}

// withRatio sets the row's ratio column and its goal check (goalMin <= 0 means
// no goal).
func (r Row) withRatio(ratio float64, def string, goalMin float64) Row {
	if math.IsNaN(ratio) || math.IsInf(ratio, 0) {
		return r
	}
	r.Ratio = &ratio
	r.RatioDef = def
	if goalMin > 0 {
		r.Goal = "≥ " + strconv.FormatFloat(goalMin, 'f', -1, 64)
		met := ratio >= goalMin
		r.GoalMet = &met
	}
	return r
}

// withGoal sets the row's goal column for a target on its value (not a
// ratio), e.g. "≤ 2" or "≥ 0.9", and whether the median met it.
func (r Row) withGoal(goal string, met bool) Row {
	r.Goal = goal
	r.GoalMet = &met
	return r
}

// summarize returns the median, minimum and maximum of xs (NaN for none).
func summarize(xs []float64) (median, lo, hi float64) {
	if len(xs) == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		median = s[n/2]
	} else {
		median = (s[n/2-1] + s[n/2]) / 2
	}
	return median, s[0], s[n-1]
}

// pairedRatios divides a[i] by b[i]; repetitions were interleaved, so pairs
// share the machine's state. With unequal lengths it falls back to the ratio
// of the medians.
func pairedRatios(a, b []float64) []float64 {
	if len(a) == 0 || len(b) == 0 {
		return nil
	}
	if len(a) != len(b) {
		ma, _, _ := summarize(a)
		mb, _, _ := summarize(b)
		return []float64{ma / mb}
	}
	out := make([]float64, len(a))
	for i := range a {
		out[i] = a[i] / b[i]
	}
	return out
}

// formatNum prints a value with a precision that suits its size.
func formatNum(v float64) string {
	switch a := math.Abs(v); {
	case math.IsNaN(v):
		return "—"
	case a >= 1000:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case a >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case a >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	case a >= 1:
		return strconv.FormatFloat(v, 'f', 2, 64)
	default:
		return strconv.FormatFloat(v, 'f', 3, 64)
	}
}

// formatRatio shows three decimals, so that a ratio just under a goal
// (0.949 against 0.95) does not print as the goal itself.
func formatRatio(v float64) string {
	if math.Abs(v) >= 10 {
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 3, 64)
}

func clientsCell(c int) string {
	if c == 0 {
		return "—"
	}
	return strconv.Itoa(c)
}

func (r Row) cells() []string {
	c := []string{r.Scenario, r.Variant, clientsCell(r.Clients), r.Metric}
	if !r.Measured() {
		note := r.Note
		if note == "" {
			note = "not measured"
		}
		return append(c, note, "", "", "")
	}
	c = append(c, formatNum(r.Median), formatNum(r.Min)+"–"+formatNum(r.Max))
	ratio := ""
	if r.Ratio != nil {
		ratio = formatRatio(*r.Ratio)
		if r.RatioDef != "" {
			ratio += " (" + r.RatioDef + ")"
		}
	}
	goal := r.Goal
	if r.GoalMet != nil {
		if *r.GoalMet {
			goal += ": met"
		} else {
			goal += ": NOT met"
		}
	}
	return append(c, ratio, goal)
}

var header = []string{"Scenario", "Variant", "Clients", "Metric", "Median", "Min–Max", "Ratio", "Goal"}

// WriteText prints rows as an aligned plain-text table.
func WriteText(w io.Writer, rows []Row) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r.cells(), "\t"))
	}
	return tw.Flush()
}

func mdEscape(s string) string { return strings.ReplaceAll(s, "|", `\|`) }

// WriteMarkdown prints rows as a GitHub-flavoured Markdown table.
func WriteMarkdown(w io.Writer, rows []Row) error {
	var b strings.Builder
	b.WriteString("| " + strings.Join(header, " | ") + " |\n")
	b.WriteString("|" + strings.Repeat("---|", len(header)) + "\n")
	for _, r := range rows {
		cells := r.cells()
		for i := range cells {
			cells[i] = mdEscape(cells[i])
		}
		b.WriteString("| " + strings.Join(cells, " | ") + " |\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// Report is everything one run produced; it is written as JSON.
type Report struct {
	Date     string   `json:"date"`
	Command  string   `json:"command"`
	Machine  Machine  `json:"machine"`
	Quick    bool     `json:"quick"`
	Duration string   `json:"duration_per_run"`
	Reps     int      `json:"repetitions"`
	Rows     []Row    `json:"rows"`
	Goals    []Goal   `json:"goals"`
	Notes    []string `json:"notes,omitempty"`
	// Safety has the safety counters of every lock variant that ran.
	Safety []SafetyCount `json:"safety,omitempty"`
}

// SafetyCount is what the in-process checks saw in every run of one lock
// variant (warm-ups and timed repetitions): grants checked, mutual-exclusion
// violations (a grant while another client of this process held the name)
// and token regressions (a grant whose token was not greater than the
// previous grant's token of the name). Both counts must be 0.
type SafetyCount struct {
	Scenario    string `json:"scenario"`
	Variant     string `json:"variant"`
	Clients     int    `json:"clients"`
	Runs        int    `json:"runs"`
	Grants      int64  `json:"grants_checked"`
	Violations  int64  `json:"mutual_exclusion_violations"`
	Tokens      bool   `json:"tokens_checked"` // false: the lock issues no token (Redis)
	Regressions int64  `json:"token_regressions"`
}

// OK reports whether the variant had neither violations nor regressions.
func (c SafetyCount) OK() bool { return c.Violations == 0 && c.Regressions == 0 }

// safetyTotals sums the counters of every variant.
func safetyTotals(cs []SafetyCount) (runs int, grants, violations, regressions int64) {
	for _, c := range cs {
		runs += c.Runs
		grants += c.Grants
		violations += c.Violations
		regressions += c.Regressions
	}
	return runs, grants, violations, regressions
}

var safetyHeader = []string{"Scenario", "Variant", "Clients", "Runs", "Grants checked", "Mutual-exclusion violations", "Token regressions"}

func (c SafetyCount) cells() []string {
	reg := "n/a (no token)"
	if c.Tokens {
		reg = strconv.FormatInt(c.Regressions, 10)
	}
	return []string{c.Scenario, c.Variant, clientsCell(c.Clients), strconv.Itoa(c.Runs),
		strconv.FormatInt(c.Grants, 10), strconv.FormatInt(c.Violations, 10), reg}
}

// WriteSafety prints the safety counters as a Markdown table.
func WriteSafety(w io.Writer, cs []SafetyCount) error {
	var b strings.Builder
	b.WriteString("| " + strings.Join(safetyHeader, " | ") + " |\n")
	b.WriteString("|" + strings.Repeat("---|", len(safetyHeader)) + "\n")
	for _, c := range cs {
		cells := c.cells()
		for i := range cells {
			cells[i] = mdEscape(cells[i])
		}
		b.WriteString("| " + strings.Join(cells, " | ") + " |\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteSafetyText prints the safety counters as an aligned plain-text table.
func WriteSafetyText(w io.Writer, cs []SafetyCount) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(safetyHeader, "\t"))
	for _, c := range cs {
		fmt.Fprintln(tw, strings.Join(c.cells(), "\t"))
	}
	return tw.Flush()
}

// Machine describes where the run happened.
type Machine struct {
	CPUs       int    `json:"cpus"`
	CPUModel   string `json:"cpu_model,omitempty"`
	GoVersion  string `json:"go_version"`
	PostgreSQL string `json:"postgresql"`
	Durability string `json:"durability"`
	Etcd       string `json:"etcd,omitempty"`
	Redis      string `json:"redis,omitempty"`
	// RedisDurable is the persistence of P3's Redis as the server reported it.
	RedisDurable string `json:"redis_durable,omitempty"`
}

// Goal is one target of the issue and whether this run met it.
type Goal struct {
	Name   string `json:"name"`
	Target string `json:"target"`
	Value  string `json:"value"`
	Status string `json:"status"` // "met", "NOT met", "not measured"
}

// WriteJSON writes the report as indented JSON. NaN values (not measured)
// become null.
func WriteJSON(w io.Writer, rep Report) error {
	type jrow struct {
		Row
		Median *float64 `json:"median"`
		Min    *float64 `json:"min"`
		Max    *float64 `json:"max"`
	}
	num := func(v float64) *float64 {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil
		}
		return &v
	}
	rows := make([]jrow, len(rep.Rows))
	for i, r := range rep.Rows {
		rows[i] = jrow{Row: r, Median: num(r.Median), Min: num(r.Min), Max: num(r.Max)}
	}
	out := struct {
		Report
		Rows []jrow `json:"rows"`
	}{rep, rows}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

// WriteGoals prints the goal summary as a Markdown list.
func WriteGoals(w io.Writer, goals []Goal) error {
	var b strings.Builder
	for _, g := range goals {
		fmt.Fprintf(&b, "- %s (target %s): %s — %s\n", g.Name, g.Target, g.Value, g.Status)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
