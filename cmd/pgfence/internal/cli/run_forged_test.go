//go:build linux

package cli

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// `pgfence run` waiting for a held lease does not run its command on a
// forged handoff notification (one that names its wait, with the next token
// or a higher one): only the real release starts it, with the token the
// database granted.
func TestRunForgedHandoff(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := t.Context()
	const name = "run-forged"
	owner, err := pglock.New(pool, &pglock.Config{Holder: "owner"})
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close()
	held, err := owner.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	marker := newMarker()
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", name, "--holder", "cmd", "--ttl", "1m",
		"--", "sh", "-c", "echo ran token=$PGFENCE_TOKEN # "+marker)
	var wkey, waitID int64
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		err := pool.QueryRow(ctx, "SELECT wkey, wait_id FROM pgfence.lock_queue WHERE name = $1 AND holder = 'cmd' AND granted_token IS NULL", name).Scan(&wkey, &waitID)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgfence run did not queue for %s: %v", name, err)
		}
	}
	far := time.Now().Add(time.Hour).UnixMicro()
	for _, tok := range []int64{held.Token() + 1, held.Token() + 1000} {
		if _, err := pool.Exec(ctx, "SELECT pg_notify($1, $2)", "pgfence_lock_handoff", fmt.Sprintf("%d %d %d %d", wkey, waitID, tok, far)); err != nil {
			t.Fatal(err)
		}
	}
	// Before the fix the command ran within milliseconds of the forged
	// notification; give it a window of two seconds to show.
	if l, found, _ := findLine(p.out, "ran token=", 2*time.Second); found {
		t.Fatalf("the command ran on a forged notification: %q", l.text)
	}
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l := waitLine(t, p, p.out, "ran token=", 30*time.Second)
	if want := fmt.Sprintf("ran token=%d", held.Token()+1); !strings.Contains(l.text, want) {
		t.Fatalf("command printed %q, want %q (the token the release handed over)", l.text, want)
	}
	if code := p.wait(t, 30*time.Second); code != 0 {
		t.Fatalf("pgfence run exited %d", code)
	}
}
