package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

func lockState(t *testing.T, dsn, name string) lockView {
	t.Helper()
	r := run(t, dsn, "locks", "show", name, "--json")
	if r.code != 0 {
		t.Fatalf("locks show %s: %+v", name, r)
	}
	var v lockView
	if err := json.Unmarshal([]byte(r.stdout), &v); err != nil {
		t.Fatal(err)
	}
	return v
}

func TestRunPassesTokenAndExitStatus(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	r := run(t, dsn, "run", "--lock", "job", "--ttl", "10s", "--", "sh", "-c", `echo "token=$PGFENCE_TOKEN lock=$PGFENCE_LOCK holder=$PGFENCE_HOLDER"`)
	if r.code != 0 || !strings.Contains(r.stdout, "token=1 lock=job holder=") {
		t.Fatalf("run: %+v", r)
	}
	if v := lockState(t, dsn, "job"); v.State != "free" || v.Token != 1 {
		t.Fatalf("after run: %+v", v)
	}
	r = run(t, dsn, "run", "--lock", "job", "--", "sh", "-c", `echo "token=$PGFENCE_TOKEN"; exit 7`)
	if r.code != 7 || !strings.Contains(r.stdout, "token=2") {
		t.Fatalf("exit status: %+v", r)
	}
	r = run(t, dsn, "run", "--lock", "job", "--", "/nonexistent/command")
	if r.code != ExitCommandNotFound {
		t.Fatalf("missing command: %+v", r)
	}
	if v := lockState(t, dsn, "job"); v.State != "free" {
		t.Fatalf("lock not released after failed start: %+v", v)
	}
	for _, args := range [][]string{
		{"run", "--", "true"},
		{"run", "--lock", "x", "--ttl", "0s", "--", "true"},
		{"run", "--lock", "x", "--ttl", "-5s", "--", "true"},
		{"run", "--lock", strings.Repeat("n", 513), "--", "true"},
		{"run", "--lock", "x"},
	} {
		if r := run(t, dsn, args...); r.code != ExitUsage {
			t.Errorf("%v: code %d, want %d (%s)", args, r.code, ExitUsage, r.stderr)
		}
	}
}

func TestRunNoWaitBusy(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	locker, err := pglock.New(pool, &pglock.Config{Holder: "other-host/1"})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.TryAcquire(ctx, "busy", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(ctx)

	marker := filepath.Join(t.TempDir(), "ran")
	r := run(t, dsn, "run", "--lock", "busy", "--no-wait", "--", "touch", marker)
	if r.code != ExitLockBusy || !strings.Contains(r.stderr, "other-host/1") {
		t.Fatalf("busy: %+v", r)
	}
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Fatal("command ran although the lock was busy")
	}
	if v := lockState(t, dsn, "busy"); v.Token != lease.Token() || *v.Holder != "other-host/1" {
		t.Fatalf("busy lock changed: %+v", v)
	}
}

// TestRunLeaseStolen forces the running lease's expiry into the past and lets
// another holder take the lock: the child must get SIGTERM and pgfence must
// exit with the lease-lost code.
func TestRunLeaseStolen(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	dir := t.TempDir()
	ready, term := filepath.Join(dir, "ready"), filepath.Join(dir, "term")
	script := `trap 'echo "$PGFENCE_TOKEN" > ` + term + `; exit 143' TERM
echo "$PGFENCE_TOKEN" > ` + ready + `
while :; do sleep 0.05; done`

	done := make(chan result, 1)
	go func() {
		done <- run(t, dsn, "run", "--lock", "stolen", "--ttl", "3s", "--grace", "5s", "--", "sh", "-c", script)
	}()

	// Wait for the child to start (it writes the file once it runs).
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		select {
		case r := <-done:
			t.Fatalf("run ended early: %+v", r)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("child did not start")
		}
		time.Sleep(20 * time.Millisecond)
	}

	if _, err := pool.Exec(ctx, "UPDATE pgfence.locks SET expires_at = now() - interval '1 second' WHERE name = 'stolen'"); err != nil {
		t.Fatal(err)
	}
	thief, err := pglock.New(pool, &pglock.Config{Holder: "thief/1"})
	if err != nil {
		t.Fatal(err)
	}
	defer thief.Close()
	lease, err := thief.TryAcquire(ctx, "stolen", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if lease.Token() != 2 {
		t.Fatalf("thief token %d, want 2", lease.Token())
	}

	var r result
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("pgfence run did not notice the lost lease")
	}
	if r.code != ExitLeaseLost {
		t.Fatalf("code %d, want %d: %+v", r.code, ExitLeaseLost, r)
	}
	b, err := os.ReadFile(term)
	if err != nil || strings.TrimSpace(string(b)) != "1" {
		t.Fatalf("child did not get SIGTERM (file: %q, %v)", b, err)
	}
	if v := lockState(t, dsn, "stolen"); v.Token != 2 || v.State != "held" || *v.Holder != "thief/1" {
		t.Fatalf("thief's lease disturbed: %+v", v)
	}
}

func TestAcquireRenewRelease(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	r := run(t, dsn, "acquire", "--lock", "script", "--ttl", "1m", "--holder", "cron/42", "--json")
	if r.code != 0 {
		t.Fatalf("acquire: %+v", r)
	}
	var got struct {
		Token  int64  `json:"token"`
		Key    string `json:"key"`
		Holder string `json:"holder"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil || got.Token != 1 || got.Holder != "cron/42" || len(got.Key) != 32 {
		t.Fatalf("acquire json %q: %v", r.stdout, err)
	}
	// The lease outlives the command: it is held until released or expired.
	if v := lockState(t, dsn, "script"); v.State != "held" {
		t.Fatalf("after acquire: %+v", v)
	}
	r = run(t, dsn, "acquire", "--lock", "script", "--no-wait")
	if r.code != ExitLockBusy {
		t.Fatalf("second acquire: %+v", r)
	}
	tok := strconv.FormatInt(got.Token, 10)
	if r = run(t, dsn, "renew", "--lock", "script", "--token", tok, "--key", got.Key, "--ttl", "2m"); r.code != 0 || !strings.Contains(r.stdout, "PGFENCE_EXPIRES_AT=") {
		t.Fatalf("renew: %+v", r)
	}
	if r = run(t, dsn, "renew", "--lock", "script", "--token", "99", "--key", got.Key); r.code != ExitLeaseLost {
		t.Fatalf("renew forged token: %+v", r)
	}
	// Another key, and the lease's own key with its last byte changed (a
	// fixed replacement byte would equal the key's own 1 time in 256).
	last := got.Key[30:]
	other := "00"
	if last == other {
		other = "01"
	}
	for _, key := range []string{"00112233445566778899aabbccddeeff", got.Key[:30] + other} {
		if r = run(t, dsn, "release", "--lock", "script", "--token", tok, "--key", key); r.code != ExitLeaseLost {
			t.Fatalf("release with another key: %+v", r)
		}
	}
	for _, bad := range [][]string{{"--key", "not hex"}, {"--key", "0011"}, {}} {
		args := append([]string{"release", "--lock", "script", "--token", tok}, bad...)
		if r = run(t, dsn, args...); r.code != ExitUsage {
			t.Fatalf("release %v: %+v, want usage error", bad, r)
		}
	}
	if v := lockState(t, dsn, "script"); v.State != "held" {
		t.Fatalf("a release with another key freed the lock: %+v", v)
	}
	if r = run(t, dsn, "release", "--lock", "script", "--token", tok, "--key", got.Key); r.code != 0 {
		t.Fatalf("release: %+v", r)
	}
	if r = run(t, dsn, "release", "--lock", "script", "--token", tok, "--key", got.Key); r.code != ExitLeaseLost {
		t.Fatalf("second release: %+v", r)
	}
	if v := lockState(t, dsn, "script"); v.State != "free" || v.Token != 1 {
		t.Fatalf("after release: %+v", v)
	}
	if r = run(t, dsn, "release", "--lock", "script", "--key", got.Key); r.code != ExitUsage {
		t.Fatalf("release without token: %+v", r)
	}
	// eval-able output.
	r = run(t, dsn, "acquire", "--lock", "it's", "--holder", "h")
	if r.code != 0 || !strings.Contains(r.stdout, `PGFENCE_LOCK='it'\''s'`) || !strings.Contains(r.stdout, "PGFENCE_TOKEN=1") {
		t.Fatalf("shell output: %+v", r)
	}
	out, err := exec.Command("sh", "-c", r.stdout+"\necho \"$PGFENCE_LOCK|$PGFENCE_TOKEN\"").Output()
	if err != nil || strings.TrimSpace(string(out)) != "it's|1" {
		t.Fatalf("eval: %q %v", out, err)
	}
}

// TestReleaseKeyFromEnvironment: renew and release read the lease key from
// PGFENCE_KEY when --key is not given. A --key argument is in the process
// list, readable by every user of the machine while the command runs, and
// whoever has the key can renew or release the lease; an environment
// variable is readable only by the process's own user.
func TestReleaseKeyFromEnvironment(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	r := run(t, dsn, "acquire", "--lock", "envkey", "--json")
	if r.code != 0 {
		t.Fatalf("acquire: %+v", r)
	}
	var got struct {
		Token int64  `json:"token"`
		Key   string `json:"key"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatal(err)
	}
	withKey := func(key string, args ...string) result {
		t.Helper()
		var out, errb bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		code := Main(ctx, args, Env{Stdout: &out, Stderr: &errb, Getenv: func(k string) string {
			switch k {
			case "DATABASE_URL":
				return dsn
			case "PGFENCE_KEY":
				return key
			}
			return ""
		}})
		return result{out.String(), errb.String(), code}
	}
	tok := strconv.FormatInt(got.Token, 10)
	if r = withKey(got.Key, "renew", "--lock", "envkey", "--token", tok); r.code != 0 {
		t.Fatalf("renew with PGFENCE_KEY: %+v", r)
	}
	// --key, when given, wins over the environment.
	if r = withKey(got.Key, "release", "--lock", "envkey", "--token", tok, "--key", "00112233445566778899aabbccddeeff"); r.code != ExitLeaseLost {
		t.Fatalf("release with another --key and the right PGFENCE_KEY: %+v, want exit %d", r, ExitLeaseLost)
	}
	if r = withKey("", "release", "--lock", "envkey", "--token", tok); r.code != ExitUsage || !strings.Contains(r.stderr, "PGFENCE_KEY") {
		t.Fatalf("release with neither: %+v, want a usage error naming PGFENCE_KEY", r)
	}
	if r = withKey(got.Key, "release", "--lock", "envkey", "--token", tok); r.code != 0 {
		t.Fatalf("release with PGFENCE_KEY: %+v", r)
	}
	if v := lockState(t, dsn, "envkey"); v.State != "free" {
		t.Fatalf("after release: %+v", v)
	}
}
