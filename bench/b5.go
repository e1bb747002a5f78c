package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/pglock"
)

// holderCommand makes the bench binary act as B5's lease holder: it takes
// the lease, prints "granted <token>" and waits to be killed.
const holderCommand = "__b5-holder"

func holderMain(args []string) int {
	if len(args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: bench "+holderCommand+" DSN NAME TTL")
		return 2
	}
	ttl, err := time.ParseDuration(args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	l, err := pglock.New(pool, &pglock.Config{Holder: fmt.Sprintf("bench-b5-victim/%d", os.Getpid())})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	lease, err := l.Acquire(ctx, args[1], ttl)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Printf("granted %d\n", lease.Token())
	select {} // hold until SIGKILL
}

// b5Once starts a holder process, kills it with SIGKILL right after its
// grant, and measures how long a waiter in this process takes to get the
// lease, from the kill.
func (b *bench) b5Once(ctx context.Context, l *pglock.Locker, ttl time.Duration) (takeover time.Duration, err error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	name := fmt.Sprintf("bench-b5-%x", rand.Uint64())
	cmd := exec.CommandContext(ctx, exe, holderCommand, b.pg.benchDSN, name, ttl.String())
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(out).ReadString('\n')
		line <- s
	}()
	var victimToken int64
	select {
	case s := <-line:
		if _, err := fmt.Sscanf(strings.TrimSpace(s), "granted %d", &victimToken); err != nil {
			return 0, fmt.Errorf("holder process said %q", s)
		}
	case <-time.After(30 * time.Second):
		return 0, errors.New("holder process did not report a grant in 30s")
	}

	type result struct {
		at    time.Time
		token int64
		err   error
	}
	got := make(chan result, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, ttl+30*time.Second)
		defer cancel()
		lease, err := l.Acquire(wctx, name, 30*time.Second)
		if err != nil {
			got <- result{err: err}
			return
		}
		at := time.Now()
		_ = lease.Release(context.WithoutCancel(ctx))
		got <- result{at: at, token: lease.Token()}
	}()
	killed := time.Now()
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return 0, err
	}
	r := <-got
	if r.err != nil {
		return 0, r.err
	}
	if r.token <= victimToken {
		return 0, fmt.Errorf("takeover token %d not above the killed holder's %d", r.token, victimToken)
	}
	return r.at.Sub(killed), nil
}

func (b *bench) runB5(ctx context.Context) {
	const scen = "B5 takeover after SIGKILL"
	ttl := b.cfg.b5TTL
	variantName := fmt.Sprintf("holder process killed, TTL %s", ttl)
	l, err := pglock.New(b.pg.pool, &pglock.Config{Holder: "bench-b5-waiter"})
	if err != nil {
		b.add(notMeasured(scen, variantName, 1, "ms", err.Error()))
		return
	}
	defer l.Close()
	var samples []float64
	for rep := range b.cfg.reps {
		d, err := b.b5Once(ctx, l, ttl)
		if err != nil {
			b.progress("B5 rep %d/%d: ERROR %v", rep+1, b.cfg.reps, err)
			b.add(notMeasured(scen, variantName, 1, "ms", "error: "+err.Error()))
			return
		}
		ms := float64(d) / float64(time.Millisecond)
		samples = append(samples, ms)
		b.progress("B5 rep %d/%d: takeover %.0f ms after SIGKILL (TTL %s)", rep+1, b.cfg.reps, ms, ttl)
	}
	limit := float64(ttl+100*time.Millisecond) / float64(time.Millisecond)
	r := newRow(scen, variantName, 1, "kill→grant ms", samples)
	r.Goal = fmt.Sprintf("≤ %.0f ms", limit)
	met := r.Max <= limit
	r.GoalMet = &met
	b.add(r)
	b.b5Goal.total++
	status := "NOT met"
	if met {
		b.b5Goal.met++
		status = "met"
	}
	b.b5Goal.parts = append(b.b5Goal.parts, fmt.Sprintf("median %.0f ms, max %.0f ms, limit %.0f ms (%s)", r.Median, r.Max, limit, status))
}
