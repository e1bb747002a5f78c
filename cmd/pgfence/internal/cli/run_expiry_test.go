//go:build linux

package cli

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestRunStopsBeforeLeaseEnds: the database becomes unreachable for
// pgfence (its backends terminated, new connections refused): renewals
// fail. The tree got SIGTERM only at the lease's local deadline and SIGKILL
// --grace later, so a command that ignores SIGTERM still ran when another
// holder was granted the lease at its database expiry. It now gets SIGTERM
// --grace before the deadline and SIGKILL just before it.
func TestRunStopsBeforeLeaseEnds(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	ctx := context.Background()
	other, err := pgx.Connect(ctx, dsn) // the other holder's connection, open before the outage
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(ctx)
	var db string
	if err := other.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	marker := newMarker()
	const grace = 2 * time.Second
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "payout", "--ttl", "6s", "--grace", grace.String(),
		"--", "sh", "-c", `trap "" TERM; echo ready; sleep `+marker+` & wait; wait; wait`)
	waitLine(t, p, p.out, "ready", 30*time.Second)

	acfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	acfg.Database = "postgres"
	admin, err := pgx.ConnectConfig(ctx, acfg)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	outage := time.Now()
	if _, err := admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" ALLOW_CONNECTIONS false"); err != nil {
		t.Fatal(err)
	}
	defer admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" ALLOW_CONNECTIONS true") //nolint:errcheck
	if _, err := other.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pgfence-cli' AND datname = current_database()"); err != nil {
		t.Fatal(err)
	}
	// B takes the lease as soon as the database lets it.
	tokB, grantedAt := grantWhenFree(t, ctx, other, "payout", 30*time.Second)
	alive := len(markerProcs(marker)) > 0
	code := p.wait(t, grace+30*time.Second)
	t.Logf("outage -> B granted token %d: %v; command still running then: %v; B granted -> pgfence exit: %v (exit %d)",
		tokB, grantedAt.Sub(outage).Round(time.Millisecond), alive, p.exitAt.Sub(grantedAt).Round(time.Millisecond), code)
	if alive {
		t.Errorf("the command under lease token 1 was still running when B was granted token %d, and ran %v longer: "+
			"two holders at once (SIGTERM only at the local deadline, SIGKILL --grace after it)", tokB, p.exitAt.Sub(grantedAt).Round(time.Millisecond))
	}
}

// TestRunDropsAnotherLeasesKey: the command gets PGFENCE_LOCK, PGFENCE_TOKEN
// and PGFENCE_HOLDER of its own lease; PGFENCE_KEY and PGFENCE_EXPIRES_AT
// (exported after an earlier `eval "$(pgfence acquire)"`) passed through:
// another lease's key, next to this lease's name and token.
func TestRunDropsAnotherLeasesKey(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	cmd := exec.Command(pgfenceBin(t), "run", "--lock", "env2", "--", "sh", "-c", "env")
	cmd.Env = testEnv(dsn, "PGFENCE_KEY=00112233445566778899aabbccddeeff", "PGFENCE_EXPIRES_AT=2020-01-01T00:00:00Z")
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"PGFENCE_KEY=", "PGFENCE_EXPIRES_AT="} {
		if strings.Contains(string(out), k) {
			t.Errorf("%s of another lease passed to the command of lease env2", strings.TrimSuffix(k, "="))
		}
	}
}

// TestRunRenewedAfterTermStillKilled: a renewal that succeeded between the
// early SIGTERM and the early SIGKILL put the expiry timer to rest; when
// renewals failed again, nothing killed the tree before the new deadline
// (SIGKILL only --grace after the first SIGTERM), and another holder was
// granted the lease while the command ran. The SIGKILL now follows the
// latest deadline.
func TestRunRenewedAfterTermStillKilled(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	ctx := context.Background()
	other, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(ctx)
	var db string
	if err := other.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	acfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	acfg.Database = "postgres"
	admin, err := pgx.ConnectConfig(ctx, acfg)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	dbid := pgx.Identifier{db}.Sanitize()
	cut := func() {
		if _, err := admin.Exec(ctx, "ALTER DATABASE "+dbid+" ALLOW_CONNECTIONS false"); err != nil {
			t.Fatal(err)
		}
		if _, err := other.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pgfence-cli' AND datname = current_database()"); err != nil {
			t.Fatal(err)
		}
	}
	restore := func() {
		if _, err := admin.Exec(ctx, "ALTER DATABASE "+dbid+" ALLOW_CONNECTIONS true"); err != nil {
			t.Fatal(err)
		}
	}
	defer admin.Exec(ctx, "ALTER DATABASE "+dbid+" ALLOW_CONNECTIONS true") //nolint:errcheck
	marker := newMarker()
	defer killMarker(marker)
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "payout", "--ttl", "15s", "--grace", "60s",
		"--", "sh", "-c", `trap "" TERM; echo ready; sleep `+marker+` & wait; wait; wait`)
	waitLine(t, p, p.out, "ready", 30*time.Second)
	cut()
	term := waitLine(t, p, p.errs, "not renewed", 30*time.Second)
	restore()
	var renewed time.Time
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var ok bool
		if err := other.QueryRow(ctx, "SELECT coalesce(renewed_at > $1, false) FROM pgfence.locks WHERE name = 'payout'", term.at.Add(-50*time.Millisecond)).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		if ok {
			renewed = time.Now()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("never renewed after the SIGTERM")
		}
	}
	cut()
	t.Logf("SIGTERM note -> renewal seen: %v", renewed.Sub(term.at).Round(time.Millisecond))
	tokB, grantedAt := grantWhenFree(t, ctx, other, "payout", 60*time.Second)
	alive := len(markerProcs(marker)) > 0
	code := p.wait(t, 90*time.Second)
	p.mu.Lock()
	t.Logf("stderr:\n%s", p.stderr.String())
	p.mu.Unlock()
	t.Logf("B granted token %d %v after the SIGTERM; command alive then: %v; pgfence exit %d, %v after B's grant",
		tokB, grantedAt.Sub(term.at).Round(time.Millisecond), alive, code, p.exitAt.Sub(grantedAt).Round(time.Millisecond))
	if alive {
		t.Errorf("the command under token 1 still ran when B was granted token %d", tokB)
	}
}

// grantWhenFree asks for lock name as holder B on conn until the database
// grants it (no signal exists for another process's lease ending on the
// database clock), and returns the token and when it was granted. It fails
// the test after within.
func grantWhenFree(t *testing.T, ctx context.Context, conn *pgx.Conn, name string, within time.Duration) (int64, time.Time) {
	t.Helper()
	for deadline := time.Now().Add(within); ; time.Sleep(20 * time.Millisecond) {
		var tok *int64
		if err := conn.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant($1, 'B', 60000000, '\x000102030405060708090a0b0c0d0e0f')`, name).Scan(&tok); err != nil {
			t.Fatal(err)
		}
		if tok != nil {
			return *tok, time.Now()
		}
		if time.Now().After(deadline) {
			t.Fatal("B never granted")
		}
	}
}
