package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/pgfence/pgfence/pglock"
)

// B1 across processes: the clients of B1's acquire+release split over
// b1Procs OS processes (the bench binary re-executed), each with its own
// pool and Locker. A Locker coalesces only the calls of its own process, so
// this is the same load as the one-process row without the coalescing
// across processes.
const (
	b1Procs       = 4
	b1ProcCommand = "__b1-proc"
	// b1ProcPool is each child's pool size: four children have 32
	// connections together, enough for a Locker's statements in flight (two
	// grants and two releases) and within the server's max_connections next
	// to the bench's own pool of 48.
	b1ProcPool = 8
	// b1ProcWarmup is the shortest untimed loop of a child before its timed
	// run.
	b1ProcWarmup = 250 * time.Millisecond
)

// b1ProcResult is what a child reports after its timed run: its cycles, its
// safety counters (its own lock probe over its own names) and, per worker,
// the first and last token it was granted, so that the parent checks the
// tokens of every name across runs (and across children of successive runs).
type b1ProcResult struct {
	Ops         int64   `json:"ops"`
	ElapsedNs   int64   `json:"elapsed_ns"`
	Grants      int64   `json:"grants"`
	Violations  int64   `json:"violations"`
	Regressions int64   `json:"regressions"`
	First       []int64 `json:"first"`
	Last        []int64 `json:"last"`
	Err         string  `json:"error,omitempty"`
}

// b1ProcMain is the child: b1ProcCommand DSN HOLDER PREFIX BASE CLIENTS
// WARMUP. It opens its pool and Locker, loops Acquire → Release on names
// PREFIX-(BASE+w) from CLIENTS goroutines for WARMUP (untimed: a new process
// prepares its statements on every connection), prints "ready", waits for
// "run DURATION" on stdin, runs the same loop for DURATION and prints its
// b1ProcResult as one JSON line. Its probe checks the warm-up's grants too.
func b1ProcMain(args []string) int {
	if len(args) != 6 {
		fmt.Fprintln(os.Stderr, "usage: bench "+b1ProcCommand+" DSN HOLDER PREFIX BASE CLIENTS WARMUP")
		return 2
	}
	base, err1 := strconv.Atoi(args[3])
	clients, err2 := strconv.Atoi(args[4])
	warmup, err3 := time.ParseDuration(args[5])
	if err := errors.Join(err1, err2, err3); err != nil || clients < 1 {
		fmt.Fprintln(os.Stderr, "bad BASE, CLIENTS or WARMUP:", err)
		return 2
	}
	ctx := context.Background()
	pool, err := newPool(ctx, args[0], b1ProcPool)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer pool.Close()
	l, err := pglock.New(pool, &pglock.Config{Holder: args[1]})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer l.Close()
	names := make([]string, clients)
	for w := range names {
		names[w] = fmt.Sprintf("%s-%d", args[2], base+w)
	}
	probe := newLockProbe("", "", clients, clients, true, false)
	first, last := make([]int64, clients), make([]int64, clients)
	pr := probe.start()
	cycle := func(ctx context.Context, w, i int) error {
		st := pr.begin()
		lease, err := l.Acquire(ctx, names[w], 30*time.Second)
		if err != nil {
			return err
		}
		pr.granted(w, w, lease.Token(), st)
		if first[w] == 0 {
			first[w] = lease.Token()
		}
		last[w] = lease.Token()
		pr.releasing(w, w)
		return lease.Release(ctx)
	}
	if _, err := closedLoop(ctx, clients, warmup, cycle); err != nil {
		fmt.Fprintln(os.Stderr, "warm-up:", err)
		return 1
	}
	fmt.Println("ready")
	line, err := bufio.NewReader(os.Stdin).ReadString('\n')
	if err != nil {
		return 1 // the parent gave up
	}
	ds, ok := strings.CutPrefix(strings.TrimSpace(line), "run ")
	dur, err := time.ParseDuration(ds)
	if !ok || err != nil {
		fmt.Fprintf(os.Stderr, "bad command %q\n", line)
		return 2
	}
	res, err := closedLoop(ctx, clients, dur, cycle)
	out := b1ProcResult{Ops: res.ops, ElapsedNs: int64(res.elapsed), Grants: pr.grants.Load(),
		Violations: pr.violations.Load(), Regressions: pr.regressions.Load(), First: first, Last: last}
	if err != nil {
		out.Err = err.Error()
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		return 1
	}
	return 0
}

// b1ProcChild is one running child of the parent.
type b1ProcChild struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string // stdout lines; closed at EOF
	base  int
	n     int
}

func (c *b1ProcChild) next(ctx context.Context, timeout time.Duration) (string, error) {
	select {
	case s, ok := <-c.lines:
		if !ok {
			return "", errors.New("child process exited")
		}
		return s, nil
	case <-time.After(timeout):
		return "", fmt.Errorf("child process silent for %s", timeout)
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// b1ProcsVariant is B1's acquire+release with clients split over b1Procs
// processes. Every run starts the children, waits until all have their pool
// and Locker and have run their untimed warm-up loop, starts their timed loops together and sums their cycles/s.
// The children check mutual exclusion and tokens within their run; the
// parent folds their counts into probe and checks each name's first token of
// a run against its last token of the previous run. Names never overlap
// across children, so per-process checking is sound.
func (b *bench) b1ProcsVariant(clients int) variant {
	const scen = "B1 distinct names"
	probe := newLockProbe(scen, keyB1Procs, clients, clients, true, false)
	prefix := fmt.Sprintf("bench-b1procs-%d", clients)
	return variant{name: keyB1Procs, clients: clients, probe: probe, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		pr := probe.start()
		exe, err := os.Executable()
		if err != nil {
			return runResult{}, err
		}
		var children []*b1ProcChild
		defer func() {
			for _, c := range children {
				_ = c.in.Close()
				_ = c.cmd.Process.Kill()
				_ = c.cmd.Wait()
			}
		}()
		base := 0
		for p := range b1Procs {
			n := clients / b1Procs
			if p < clients%b1Procs {
				n++
			}
			cmd := exec.CommandContext(ctx, exe, b1ProcCommand, b.pg.benchDSN, fmt.Sprintf("bench-b1-proc%d", p),
				prefix, strconv.Itoa(base), strconv.Itoa(n), max(b.cfg.warmup, b1ProcWarmup).String())
			cmd.Stderr = os.Stderr
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			in, err := cmd.StdinPipe()
			if err != nil {
				return runResult{}, err
			}
			out, err := cmd.StdoutPipe()
			if err != nil {
				return runResult{}, err
			}
			if err := cmd.Start(); err != nil {
				return runResult{}, err
			}
			c := &b1ProcChild{cmd: cmd, in: in, lines: make(chan string, 2), base: base, n: n}
			children = append(children, c)
			go func() {
				defer close(c.lines)
				sc := bufio.NewScanner(out)
				sc.Buffer(make([]byte, 64*1024), 16<<20)
				for sc.Scan() {
					c.lines <- sc.Text()
				}
			}()
			base += n
		}
		for p, c := range children {
			s, err := c.next(ctx, 60*time.Second)
			if err != nil || s != "ready" {
				return runResult{}, fmt.Errorf("process %d not ready: %q %v", p, s, err)
			}
		}
		for _, c := range children {
			if _, err := fmt.Fprintf(c.in, "run %s\n", dur); err != nil {
				return runResult{}, err
			}
		}
		var (
			ops  int64
			rate float64
		)
		for p, c := range children {
			s, err := c.next(ctx, dur+2*time.Minute)
			if err != nil {
				return runResult{}, fmt.Errorf("process %d: %w", p, err)
			}
			var r b1ProcResult
			if err := json.Unmarshal([]byte(s), &r); err != nil {
				return runResult{}, fmt.Errorf("process %d said %q: %w", p, s, err)
			}
			pr.merge(c.base, r.Grants, r.Violations, r.Regressions, r.First, r.Last)
			if r.Err != "" {
				return runResult{}, fmt.Errorf("process %d: %s", p, r.Err)
			}
			ops += r.Ops
			if r.ElapsedNs > 0 {
				rate += float64(r.Ops) / time.Duration(r.ElapsedNs).Seconds()
			}
		}
		if rate <= 0 {
			return runResult{}, errors.New("no cycles")
		}
		// The sum of the children's cycles/s, as ops over an elapsed time.
		return runResult{ops: ops, elapsed: time.Duration(float64(ops) / rate * float64(time.Second)), elsewhere: true}, nil
	}}
}
