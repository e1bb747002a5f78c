package crosslang

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

const (
	leaseName  = "crosslang"
	itemsTable = "crosslang_items"
	lineWait   = 60 * time.Second // for a line that needs only a round trip or two
)

// startLeaseWorker starts the lease worker of lang ("python" or "go") as a
// process of its own, connected as the application role.
func startLeaseWorker(t *testing.T, lang, roleDSN, holder string, ttl time.Duration) *proc {
	t.Helper()
	args := []string{"lease-worker", "--dsn", roleDSN, "--name", leaseName, "--holder", holder,
		"--ttl-ms", strconv.FormatInt(ttl.Milliseconds(), 10), "--table", itemsTable}
	if lang == "python" {
		return startProc(t, lang+" "+holder, nil, append([]string{python(t).exe, clientPath(t)}, args...)...)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return startProc(t, lang+" "+holder, []string{helperEnv + "=1"}, append([]string{exe}, args...)...)
}

func acquiredToken(t *testing.T, p *proc) int64 {
	t.Helper()
	line, before := p.expect("acquired ", lineWait)
	tok, err := strconv.ParseInt(strings.TrimPrefix(line, "acquired "), 10, 64)
	if err != nil || len(before) != 0 {
		t.Fatalf("%s: %q after %q: %v", p.name, line, before, err)
	}
	return tok
}

// TestPythonPausedGoTakesOver: a Python holder paused past its lease, a Go
// process takes the lease over and writes; every late Python write is refused.
func TestPythonPausedGoTakesOver(t *testing.T) { takeover(t, "python", "go") }

// TestGoPausedPythonTakesOver: the same with the languages swapped.
func TestGoPausedPythonTakesOver(t *testing.T) { takeover(t, "go", "python") }

// takeover: a first process (lang first) takes lease crosslang with a short
// TTL and writes row 1 of a guarded table, and is stopped with SIGSTOP. Its
// late commands (fenced and unfenced writes of rows 1 and 2, renew, release)
// are queued on its stdin while it is stopped. Once the lease has expired on
// the database clock, a second process (lang second) takes it over (token +
// 1) and writes row 1. After SIGCONT every late command of the first is
// refused: the fenced write of row 1 changes no row (fence < token), the
// unfenced one would lower the fence (guard, PF001), both writes of row 2,
// which the new holder has not written yet, are superseded (guard, PF008),
// and renew and release find the lease lost. The rows end with the second
// process's values and token.
func takeover(t *testing.T, first, second string) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	py := python(t)
	admin, roleDSN := setup(t, ctx, `
		CREATE TABLE `+itemsTable+` (id int PRIMARY KEY, v text NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO `+itemsTable+` VALUES (1, 'seed', 0), (2, 'seed', 0);
		SELECT pgfence.guard('`+itemsTable+`', lock_name => '`+leaseName+`')`,
		"GRANT SELECT, UPDATE ON "+itemsTable+" TO %s")
	rtt := roundTrip(t, ctx, pgtest.PoolFor(t, roleDSN))
	ttl := min(max(1500*time.Millisecond, 200*rtt), 5*time.Second)

	holder := startLeaseWorker(t, first, roleDSN, first+"-holder", ttl)
	t1 := acquiredToken(t, holder)
	holder.send("write 1 " + first + "-early")
	if l := holder.next(lineWait); !strings.HasPrefix(l, fmt.Sprintf("ok write 1 %d local-valid=True", t1)) {
		t.Fatalf("%s: the holder's first write, within its TTL of %s: %q", holder.name, ttl, l)
	}
	holder.stop()
	late := []string{"write 1 " + first + "-late", "raw 1 " + first + "-late", "write 2 " + first + "-late",
		"raw 2 " + first + "-late", "renew", "release"}
	for _, c := range late {
		holder.send(c) // queued in the pipe: read after SIGCONT
	}
	pollUntil(t, ctx, time.Minute, "the lease expires on the database clock", func() (bool, error) {
		var expired bool
		err := admin.QueryRow(ctx, "SELECT expires_at <= now() FROM pgfence.locks WHERE name = $1", leaseName).Scan(&expired)
		return expired, err
	})

	taker := startLeaseWorker(t, second, roleDSN, second+"-taker", time.Minute)
	t2 := acquiredToken(t, taker)
	if t2 != t1+1 {
		t.Fatalf("the taker got token %d, want %d (the holder's %d + 1)", t2, t1+1, t1)
	}
	taker.send("write 1 " + second + "-1")
	if l := taker.next(lineWait); !strings.HasPrefix(l, fmt.Sprintf("ok write 1 %d ", t2)) {
		t.Fatalf("%s: %q", taker.name, l)
	}

	holder.signal(syscall.SIGCONT)
	want := []string{
		fmt.Sprintf("refused write 1 stale fence=%d local-valid=False", t2),
		"refused raw 1 PF001",
		"refused write 2 PF008",
		"refused raw 2 PF008",
		"refused renew lost",
		"refused release lost",
	}
	refused := 0
	for i, w := range want {
		got := holder.next(lineWait)
		if got != w {
			t.Errorf("%s, late %q: got %q, want %q", holder.name, late[i], got, w)
			continue
		}
		refused++
	}
	holder.send("exit")
	holder.wait(lineWait)

	taker.send("write 2 " + second + "-2")
	if l := taker.next(lineWait); !strings.HasPrefix(l, fmt.Sprintf("ok write 2 %d ", t2)) {
		t.Fatalf("%s: %q", taker.name, l)
	}
	taker.send("release")
	if l := taker.next(lineWait); l != "ok release" {
		t.Fatalf("%s: %q", taker.name, l)
	}
	taker.send("exit")
	taker.wait(lineWait)

	rows, err := admin.Query(ctx, "SELECT id, v, fence FROM "+itemsTable+" ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	var final []string
	for rows.Next() {
		var id, fence int64
		var v string
		if err := rows.Scan(&id, &v, &fence); err != nil {
			t.Fatal(err)
		}
		final = append(final, fmt.Sprintf("(%d, %s, fence %d)", id, v, fence))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	wantRows := []string{fmt.Sprintf("(1, %s-1, fence %d)", second, t2), fmt.Sprintf("(2, %s-2, fence %d)", second, t2)}
	if strings.Join(final, " ") != strings.Join(wantRows, " ") {
		t.Errorf("final rows %v, want %v", final, wantRows)
	}
	t.Logf("Python %s, psycopg %s; round trip %s, TTL %s; %s holder token %d paused, %s taker token %d; "+
		"late commands refused %d/%d; final rows %v", py.version, py.psycopg, rtt, ttl, first, t1, second, t2,
		refused, len(want), final)
}
