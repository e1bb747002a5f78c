// Command bench measures pgfence side by side with the physical limit of its
// PostgreSQL server (one commit per operation), with etcd's and Redis's locks
// and with River's job queue, on the same machine in one run, and prints one
// table (also written as Markdown and JSON).
//
//	cd bench && go run . [--quick] [--out results]
//
// It starts its own PostgreSQL with default durability (fsync and
// synchronous_commit on) and, when their binaries are installed, a loopback
// etcd and Redis. See README.md for the scenarios.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

type config struct {
	quick   bool
	dsn     string
	out     string
	dur     time.Duration
	warmup  time.Duration
	reps    int
	clients []int
	jobs    int
	only    map[string]bool
	noEtcd  bool
	noRedis bool
	b5TTL   time.Duration
	// b1Extra are client counts measured only for B1 acquire+release (one
	// process and across processes) with L0 random row and P3 distinct keys
	// for its ratios, not for every scenario.
	b1Extra  []int
	k1Leases int
	k1Window time.Duration
}

type bench struct {
	cfg     config
	log     io.Writer
	start   time.Time
	rows    []Row
	notes   []string
	mach    Machine
	goals   []Goal
	memRows []Row
	series  map[string][]float64

	b1Goal, b3Goal, b4Goal, b5Goal           goalCheck
	b3GuardGoal, b1ProcsGoal, o1Goal, k1Goal goalCheck
	redisNote                                string

	pg           *pgEnv
	etcd         *clientv3.Client // nil: P1 not run
	redisAddr    string           // empty: P2 not run
	redisAOFAddr string           // empty: P3 not run

	safety  []SafetyCount // safety counters of every lock variant run
	b2Goals []*goalCheck  // hot-name goals on B2 LISTEN (fairness, wait, bypass)
}

func (b *bench) progress(format string, args ...any) {
	el := time.Since(b.start).Round(time.Second)
	fmt.Fprintf(b.log, "[%5s] %s\n", el, fmt.Sprintf(format, args...))
}

func (b *bench) add(rows ...Row) { b.rows = append(b.rows, rows...) }

func (b *bench) note(format string, args ...any) {
	b.notes = append(b.notes, fmt.Sprintf(format, args...))
}

func (b *bench) want(scenario string) bool {
	return len(b.cfg.only) == 0 || b.cfg.only[scenario]
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == holderCommand {
		os.Exit(holderMain(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == b1ProcCommand {
		os.Exit(b1ProcMain(os.Args[2:]))
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		cfg     config
		clients string
		b1Extra string
		only    string
	)
	fs.BoolVar(&cfg.quick, "quick", false, "short runs (about 3 minutes): 300ms per repetition, fewer jobs, a 20s K1 window")
	fs.StringVar(&cfg.dsn, "dsn", "", "use this PostgreSQL server (superuser DSN) instead of starting one; B5 and durability are then the server's")
	fs.StringVar(&cfg.out, "out", "results", "directory for results.md and results.json")
	fs.DurationVar(&cfg.dur, "duration", 0, "length of one timed repetition (default 2s, 300ms with --quick)")
	fs.IntVar(&cfg.reps, "reps", 3, "repetitions per configuration (at least 3 for a median)")
	fs.StringVar(&clients, "clients", "1,8,32", "comma-separated client counts")
	fs.IntVar(&cfg.jobs, "jobs", 0, "jobs per burn-down repetition in B4 (default 10000, 1500 with --quick)")
	fs.StringVar(&b1Extra, "b1-clients", "128", "comma-separated client counts measured only for B1 acquire+release (one process and 4 processes), L0 random row and P3 distinct keys; empty for none")
	fs.IntVar(&cfg.k1Leases, "k1-leases", 10000, "leases kept alive by one Locker in K1")
	fs.DurationVar(&cfg.k1Window, "k1-window", 0, "how long K1 keeps its leases alive (default 60s, 20s with --quick)")
	fs.StringVar(&only, "only", "", "comma-separated scenarios to run (L0,B1,B2,B3,B4,B5,O1,K1,P1,P2,P3,M); default all")
	fs.BoolVar(&cfg.noEtcd, "no-etcd", false, "skip P1 even if etcd is installed")
	fs.BoolVar(&cfg.noRedis, "no-redis", false, "skip P2 and P3 even if redis-server is installed")
	fs.DurationVar(&cfg.b5TTL, "b5-ttl", time.Second, "lease TTL of the killed holder in B5")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if cfg.dur == 0 {
		cfg.dur = 2 * time.Second
		if cfg.quick {
			cfg.dur = 300 * time.Millisecond
		}
	}
	cfg.warmup = cfg.dur / 4
	if cfg.k1Window == 0 {
		cfg.k1Window = time.Minute
		if cfg.quick {
			cfg.k1Window = 20 * time.Second
		}
	}
	if cfg.k1Leases < 1 {
		fmt.Fprintln(stderr, "bench: --k1-leases must be at least 1")
		return 2
	}
	if cfg.jobs == 0 {
		cfg.jobs = 10000
		if cfg.quick {
			cfg.jobs = 1500
		}
	}
	if cfg.reps < 1 {
		fmt.Fprintln(stderr, "bench: --reps must be at least 1")
		return 2
	}
	var err error
	if cfg.clients, err = parseClients(clients); err != nil || len(cfg.clients) == 0 {
		fmt.Fprintf(stderr, "bench: --clients: %v\n", err)
		return 2
	}
	if cfg.b1Extra, err = parseClients(b1Extra); err != nil {
		fmt.Fprintf(stderr, "bench: --b1-clients: %v\n", err)
		return 2
	}
	if only != "" {
		cfg.only = map[string]bool{}
		for _, s := range strings.Split(only, ",") {
			cfg.only[strings.ToUpper(strings.TrimSpace(s))] = true
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	b := &bench{cfg: cfg, log: stderr, start: time.Now()}
	b.b1Goal = goalCheck{name: "B1 acquire + fenced write + release vs the UPDATE limit", target: "≥ 0.9 × (L0 random ÷ 3 commits)"}
	b.b3Goal = goalCheck{name: "B3 fenced UPDATE vs unconditional UPDATE", target: "≥ 0.95"}
	b.b3GuardGoal = goalCheck{name: "B3 fenced UPDATE with the guard trigger attached vs unconditional UPDATE", target: "≥ 0.85"}
	b.b1ProcsGoal = goalCheck{name: "B1 acquire+release across 4 processes vs the UPDATE limit", target: "≥ 0.9 × (L0 random ÷ 2 commits) at 32 clients"}
	b.k1Goal = goalCheck{name: "K1 10,000 leases kept alive by one Locker", target: "0 leases lost"}
	b.o1Goal = goalCheck{name: "O1 outbox.Dispatcher vs skiplocked.Worker", target: "≥ 0.9 × Worker"}
	b.b4Goal = goalCheck{name: "B4 pgfence claim+complete vs River", target: "≥ 1.0 × River"}
	b.b5Goal = goalCheck{name: "B5 takeover after SIGKILL of the holder", target: "≤ TTL + 100 ms"}
	if err := b.runAll(ctx); err != nil {
		fmt.Fprintf(stderr, "bench: %v\n", err)
		return 1
	}
	rep := b.report(args)
	fmt.Fprintln(stdout)
	if err := WriteText(stdout, rep.Rows); err != nil {
		fmt.Fprintf(stderr, "bench: %v\n", err)
		return 1
	}
	if len(rep.Safety) > 0 {
		fmt.Fprintln(stdout)
		fmt.Fprintln(stdout, "Safety checks (every run, warm-ups included):")
		_ = WriteSafetyText(stdout, rep.Safety)
	}
	fmt.Fprintln(stdout)
	fmt.Fprintln(stdout, "Goals:")
	_ = WriteGoals(stdout, rep.Goals)
	for _, n := range rep.Notes {
		fmt.Fprintln(stdout, "note:", n)
	}
	if err := writeFiles(cfg.out, rep); err != nil {
		fmt.Fprintf(stderr, "bench: %v\n", err)
		return 1
	}
	chart := filepath.Join(cfg.out, "throughput.png")
	if err := writeChart(chart, rep.Rows, b.allClients()); err != nil {
		fmt.Fprintf(stderr, "bench: no chart: %v\n", err)
		chart = ""
	}
	fmt.Fprintf(stdout, "\nwrote %s, %s and %s (total %s)\n", filepath.Join(cfg.out, "results.md"),
		filepath.Join(cfg.out, "results.json"), chart, time.Since(b.start).Round(time.Second))
	if _, _, v, r := safetyTotals(rep.Safety); v != 0 || r != 0 {
		fmt.Fprintf(stderr, "bench: SAFETY FAILURE: %d mutual-exclusion violations and %d token regressions (see the safety table)\n", v, r)
		return 3
	}
	return 0
}

func (b *bench) report(args []string) Report {
	cmd := "go run ."
	if len(args) > 0 {
		cmd += " " + strings.Join(args, " ")
	}
	b.mach.CPUs = runtime.NumCPU()
	b.mach.CPUModel = cpuModel()
	b.mach.GoVersion = runtime.Version()
	return Report{
		Date:     b.start.UTC().Format(time.RFC3339),
		Command:  cmd,
		Machine:  b.mach,
		Quick:    b.cfg.quick,
		Duration: b.cfg.dur.String(),
		Reps:     b.cfg.reps,
		Rows:     b.rows,
		Goals:    b.goals,
		Notes:    b.notes,
		Safety:   b.safety,
	}
}

func writeFiles(dir string, rep Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var md strings.Builder
	fmt.Fprintf(&md, "Run of %s (`%s`): %d CPUs (%s), %s, durability: %s, %s",
		rep.Date, rep.Command, rep.Machine.CPUs, rep.Machine.CPUModel, rep.Machine.PostgreSQL,
		rep.Machine.Durability, rep.Machine.GoVersion)
	if rep.Machine.Etcd != "" {
		fmt.Fprintf(&md, ", %s", rep.Machine.Etcd)
	}
	if rep.Machine.Redis != "" {
		fmt.Fprintf(&md, ", %s", rep.Machine.Redis)
	}
	if rep.Machine.RedisDurable != "" {
		fmt.Fprintf(&md, " (P3: %s)", rep.Machine.RedisDurable)
	}
	fmt.Fprintf(&md, ". Median of %d repetitions of %s each (burn-downs: %s).\n\n", rep.Reps, rep.Duration, "whole queue")
	if err := WriteMarkdown(&md, rep.Rows); err != nil {
		return err
	}
	if len(rep.Safety) > 0 {
		md.WriteString("\nSafety checks (every run, warm-ups included; both counts must be 0):\n\n")
		if err := WriteSafety(&md, rep.Safety); err != nil {
			return err
		}
	}
	md.WriteString("\nGoals:\n\n")
	_ = WriteGoals(&md, rep.Goals)
	if len(rep.Notes) > 0 {
		md.WriteString("\nNotes:\n\n")
		for _, n := range rep.Notes {
			md.WriteString("- " + n + "\n")
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "results.md"), []byte(md.String()), 0o644); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, "results.json"))
	if err != nil {
		return err
	}
	if err := WriteJSON(f, rep); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// parseClients parses a comma-separated list of client counts (1 to 256);
// an empty string is an empty list.
func parseClients(list string) ([]int, error) {
	var out []int
	if strings.TrimSpace(list) == "" {
		return nil, nil
	}
	for _, s := range strings.Split(list, ",") {
		var n int
		if _, err := fmt.Sscan(strings.TrimSpace(s), &n); err != nil || n < 1 || n > 256 {
			return nil, fmt.Errorf("bad client count %q", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// allClients is every client count of the run, sorted: --clients and
// --b1-clients.
func (b *bench) allClients() []int {
	out := slices.Clone(b.cfg.clients)
	for _, c := range b.cfg.b1Extra {
		if !slices.Contains(out, c) {
			out = append(out, c)
		}
	}
	slices.Sort(out)
	return out
}

// b1Only reports whether c is measured only for B1 acquire+release (a
// --b1-clients count not in --clients).
func (b *bench) b1Only(c int) bool { return !slices.Contains(b.cfg.clients, c) }
