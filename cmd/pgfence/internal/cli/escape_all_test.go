//go:build linux

package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// evil holds every character a terminal acts on that TestEscapeEveryCommand
// looks for: CSI (set colour), OSC (set the window title, ended by BEL), BEL,
// CR, backspace, the C1 control CSI (U+009B), and bidirectional controls
// (right-to-left override, the isolates U+2066..U+2069, right-to-left mark).
// 36 bytes: it fits in an identifier with a prefix.
const evil = "\x1b[31m" + "\x1b]0;t\x07" + "\a\r\b" + "\u009b2J" + "\u202e\u2066\u2067\u2068\u2069\u200f"

// evilRunes are the runes of evil that must never reach the output raw.
var evilRunes = []rune{0x1b, 0x07, '\r', '\b', 0x9b, 0x202e, 0x2066, 0x2067, 0x2068, 0x2069, 0x200f}

// escapeCase is one invocation of the CLI and what its output must show.
type escapeCase struct {
	args []string
	code int
	// shows: the output must carry evil escaped (\x1b[31m, or \u001b[31m in
	// JSON), proof that the hostile value reached the printing code.
	shows bool
	// shell: stdout holds shell assignments; eval by sh must give back
	// exactly these PGFENCE_LOCK and PGFENCE_HOLDER (instead of shows).
	shell []string
	// bin runs the pgfence binary instead of Main in-process (pgfence run
	// re-executes itself as its supervisor).
	bin bool
}

// TestEscapeEveryCommand stores evil in every string pgfence reads from the
// database and prints (lock names, holders, metadata, role and application
// names, queue names, job and outbox payloads, table and column names, key
// values), runs every command that prints such a string, and checks that
// stdout and stderr contain none of evil's characters raw (nor any other
// control, format or invalid character). The table covers every command of
// the root command: a new command needs a case here, or an entry in
// noDatabaseText saying why it prints nothing from the database.
func TestEscapeEveryCommand(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sql := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	meta, _ := json.Marshal(map[string]string{"note": evil})
	// A held lock: name, holder and metadata hostile; and one with a plain
	// name held by a hostile holder (acquire/run --no-wait name the holder).
	sql(`INSERT INTO pgfence.locks (name, token, holder, acquired_at, expires_at, metadata)
		VALUES ($1, 7, $2, now(), now() + interval '1 hour', $3),
		       ('busy', 3, $2, now(), now() + interval '1 hour', $3)`, "n"+evil, "h"+evil, meta)
	// Jobs and outbox: queue, payload, error text, lock name.
	sql(`INSERT INTO pgfence.jobs (queue, payload, last_error) VALUES ($1, $2, $3)`, "q"+evil, meta, "e"+evil)
	sql(`INSERT INTO pgfence.jobs (id, queue, payload) OVERRIDING SYSTEM VALUE VALUES (1000001, 'outbox:mail', $1)`, meta)
	sql(`INSERT INTO pgfence.outbox (id, topic, idempotency_key, lock_name, token, payload)
		VALUES (1000001, 'mail', 'key-1', $1, 7, $2)`, "n"+evil, meta)
	// A fenced table whose name, columns, keys and lock names are hostile.
	table, key, lockCol := "t"+evil, "k"+evil, "l"+evil
	sql(fmt.Sprintf(`CREATE TABLE %s (%s text PRIMARY KEY, %s text NOT NULL, fence bigint NOT NULL DEFAULT 0)`,
		pgx.Identifier{table}.Sanitize(), pgx.Identifier{key}.Sanitize(), pgx.Identifier{lockCol}.Sanitize()))
	sql(fmt.Sprintf(`INSERT INTO %s VALUES ($1, $2, 9)`, pgx.Identifier{table}.Sanitize()), "v"+evil, "n"+evil)
	// An advisory lock held by a session of a hostile role with a hostile
	// application_name.
	role := advisoryHostile(t, ctx, dsn)

	// Leases for renew and release to use.
	acquire := func(name string) (token, key string) {
		t.Helper()
		r := run(t, dsn, "acquire", "--lock", name, "--holder", "h"+evil, "--json")
		var lease struct {
			Token int64  `json:"token"`
			Key   string `json:"key"`
		}
		if err := json.Unmarshal([]byte(r.stdout), &lease); err != nil || lease.Token == 0 || lease.Key == "" {
			t.Fatalf("acquire --json: %+v %v", r, err)
		}
		return fmt.Sprint(lease.Token), lease.Key
	}
	renewTok, renewKey := acquire("renew" + evil)
	releaseTok, releaseKey := acquire("release" + evil)
	const otherKey = "00112233445566778899aabbccddeeff"

	cases := map[string][]escapeCase{
		"pgfence locks": {
			{args: []string{"locks"}, shows: true},
			{args: []string{"locks", "--json"}, shows: true},
			{args: []string{"locks", "--name", "%" + evil + "%"}, shows: true},
		},
		"pgfence locks show": {
			{args: []string{"locks", "show", "n" + evil}, shows: true},
			{args: []string{"locks", "show", "n" + evil, "--json"}, shows: true},
			{args: []string{"locks", "show", "missing" + evil}, code: ExitNotFound, shows: true},
		},
		"pgfence fences": {
			{args: []string{"fences", "--table", table, "--key", key, "--lock-column", lockCol}, code: ExitForged, shows: true},
			{args: []string{"fences", "--table", table, "--key", key, "--lock-column", lockCol, "--json"}, code: ExitForged, shows: true},
			{args: []string{"fences", "--table", table, "--key", key, "--lock", "n" + evil}, code: ExitForged, shows: true},
			{args: []string{"fences", "--table", table, "--key", key, "--lock", "missing" + evil}, code: ExitNotFound, shows: true},
			{args: []string{"fences", "--table", "missing" + evil, "--lock", "x"}, code: ExitNotFound, shows: true},
			{args: []string{"fences", "--table", table, "--key", "missing" + evil, "--lock", "x"}, code: ExitNotFound, shows: true},
			{args: []string{"fences", "--table", table, "--key", key, "--fence-column", lockCol, "--lock", "x"}, code: ExitNotFound, shows: true},
		},
		"pgfence advisory list": {
			{args: []string{"advisory", "list"}, shows: true},
			{args: []string{"advisory", "list", "--json"}, shows: true},
		},
		"pgfence jobs": {
			{args: []string{"jobs"}, shows: true},
			{args: []string{"jobs", "--json"}, shows: true},
			{args: []string{"jobs", "--queue", "q" + evil}, code: ExitUsage, shows: true}, // such a name is refused, not looked up
			{args: []string{"jobs", "--queue", "missing"}, code: ExitNotFound},
		},
		"pgfence outbox": {
			{args: []string{"outbox"}},
			{args: []string{"outbox", "--json"}},
			{args: []string{"outbox", "--topic", "t" + evil}, code: ExitUsage, shows: true},
		},
		"pgfence acquire": {
			{args: []string{"acquire", "--lock", "busy", "--no-wait"}, code: ExitLockBusy, shows: true},
			{args: []string{"acquire", "--lock", "b" + evil, "--holder", "h" + evil}, shell: []string{"b" + evil, "h" + evil}},
			{args: []string{"acquire", "--lock", "c" + evil, "--holder", "h" + evil, "--json"}, shows: true},
		},
		"pgfence run": {
			{args: []string{"run", "--lock", "busy", "--no-wait", "--", "true"}, code: ExitLockBusy, shows: true},
			{args: []string{"run", "--lock", "r" + evil, "--holder", "h" + evil, "--", "true"}, shows: true, bin: true},
			{args: []string{"run", "--lock", "busy", "--no-wait", "--", "true"}, code: ExitLockBusy, shows: true, bin: true},
		},
		"pgfence renew": {
			{args: []string{"renew", "--lock", "n" + evil, "--token", "7", "--key", otherKey}, code: ExitLeaseLost, shows: true},
			{args: []string{"renew", "--lock", "renew" + evil, "--token", renewTok, "--key", renewKey}},
			{args: []string{"renew", "--lock", "renew" + evil, "--token", renewTok, "--key", renewKey, "--json"}},
		},
		"pgfence release": {
			{args: []string{"release", "--lock", "n" + evil, "--token", "7", "--key", otherKey}, code: ExitLeaseLost, shows: true},
			{args: []string{"release", "--lock", "release" + evil, "--token", releaseTok, "--key", releaseKey}, shows: true},
		},
		"pgfence gen fenced": {
			{args: []string{"gen", "fenced", "--table", table, "--key", key, "--set", lockCol, "--check", "--dry-run",
				"--migrations-dir", t.TempDir(), "--queries-dir", t.TempDir()}, code: ExitUsage, shows: true},
		},
		"pgfence migrate status":  {{args: []string{"migrate", "status"}}, {args: []string{"migrate", "status", "--json"}}},
		"pgfence migrate version": {{args: []string{"migrate", "version"}}},
		"pgfence migrate up":      {{args: []string{"migrate", "up"}}},
	}
	// Commands that print no string read from the database, and why.
	noDatabaseText := map[string]string{
		"pgfence":                       "prints its help only",
		"pgfence migrate":               "a group: prints its help only",
		"pgfence migrate down":          "prints migration file names and versions compiled into pgfence (run above as up and status on the same table)",
		"pgfence gen":                   "a group: prints its help only",
		"pgfence advisory":              "a group: prints its help only",
		"pgfence completion":            "a group (cobra's): prints its help only",
		"pgfence completion bash":       "prints a shell completion script generated from the command tree",
		"pgfence completion fish":       "prints a shell completion script generated from the command tree",
		"pgfence completion powershell": "prints a shell completion script generated from the command tree",
		"pgfence completion zsh":        "prints a shell completion script generated from the command tree",
		"pgfence version":               "prints build information compiled into the binary",
		"pgfence exporter": "prints its listen address; its log lines are log/slog text records, which quote values " +
			"with control or format characters; the metrics go over HTTP",
		"pgfence demo": "prints what it creates itself (its own lock, table and integer balances), " +
			"on a throwaway database unless given one",
		"pgfence demo-worker": "internal to pgfence demo (hidden); reports integers to it on a pipe",
	}

	var paths []string
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		paths = append(paths, c.CommandPath())
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk((&app{}).rootCommand())
	for _, p := range paths {
		_, tested := cases[p]
		_, exempt := noDatabaseText[p]
		if !tested && !exempt {
			t.Errorf("command %q has no case in TestEscapeEveryCommand: feed it hostile data, or say in noDatabaseText why it prints nothing from the database", p)
		}
	}
	if t.Failed() {
		return
	}

	for path, cs := range cases {
		for _, c := range cs {
			label := fmt.Sprintf("%s %q", path, c.args)
			var r result
			if c.bin {
				r = runBin(t, dsn, c.args...)
			} else {
				r = run(t, dsn, c.args...)
			}
			if r.code != c.code {
				t.Errorf("%s: exit %d, want %d\nstdout %q\nstderr %q", label, r.code, c.code, r.stdout, r.stderr)
			}
			for _, out := range []struct{ name, s string }{{"stdout", r.stdout}, {"stderr", r.stderr}} {
				var raw []string
				for _, bad := range evilRunes {
					if strings.ContainsRune(out.s, bad) {
						raw = append(raw, fmt.Sprintf("%U", bad))
					}
				}
				if bad, ok := termClean(out.s); !ok || len(raw) > 0 {
					t.Errorf("%s: %s contains %v raw (first: %s): %q", label, out.name, raw, bad, out.s)
				}
			}
			if testing.Verbose() {
				t.Logf("%s:\nstdout %q\nstderr %q", label, r.stdout, r.stderr)
			}
			if c.shell != nil {
				if got := shellEval(t, r.stdout, "PGFENCE_LOCK", "PGFENCE_HOLDER"); strings.Join(got, "|") != strings.Join(c.shell, "|") {
					t.Errorf("%s: sh reads back %q, want %q", label, got, c.shell)
				}
			}
			all := r.stdout + r.stderr
			if c.shows && !strings.Contains(all, `\x1b[31m`) && !strings.Contains(all, `\u001b[31m`) {
				t.Errorf("%s: the hostile value is not in the output (escaped):\nstdout %q\nstderr %q", label, r.stdout, r.stderr)
			}
		}
	}
	// advisory list --json carries the exact role and application name.
	var rows []struct {
		User string `json:"user"`
		App  string `json:"application_name"`
	}
	r := run(t, dsn, "advisory", "list", "--json")
	if err := json.Unmarshal([]byte(r.stdout), &rows); err != nil || len(rows) != 1 || rows[0].User != role {
		t.Errorf("advisory list --json: %+v %v, want role %q", rows, err, role)
	}
}

// advisoryHostile creates a login role whose name holds evil and keeps an
// advisory lock in a session of that role until t ends. It returns the role
// name.
func advisoryHostile(t *testing.T, ctx context.Context, dsn string) string {
	t.Helper()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	role := "r" + evil + hex.EncodeToString(b)
	admin := pgtest.PoolFor(t, dsn)
	if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.User = role
	cfg.RuntimeParams["application_name"] = "app" + evil
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect as the hostile role: %v", err)
	}
	t.Cleanup(func() {
		conn.Close(context.Background())
		_, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+pgx.Identifier{role}.Sanitize())
	})
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(424242)"); err != nil {
		t.Fatal(err)
	}
	// The server replaces non-ASCII and control bytes of application_name
	// with '?', so only the role name arrives raw; the application name is
	// set anyway, should a server ever keep it.
	return role
}

// runBin runs the pgfence binary with DATABASE_URL=dsn.
func runBin(t *testing.T, dsn string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, pgfenceBin(t), args...)
	cmd.Env = []string{"DATABASE_URL=" + dsn, "PATH=/usr/bin:/bin"}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if err != nil {
		ee, ok := err.(*exec.ExitError)
		if !ok {
			t.Fatalf("pgfence %q: %v", args, err)
		}
		code = ee.ExitCode()
	}
	if !utf8.Valid(out.Bytes()) {
		t.Logf("pgfence %q: stdout is not UTF-8", args)
	}
	return result{out.String(), errb.String(), code}
}

// shellEval runs script in sh and returns the values of vars after it.
func shellEval(t *testing.T, script string, vars ...string) []string {
	t.Helper()
	var show []string
	for _, v := range vars {
		show = append(show, `"$`+v+`"`)
	}
	out, err := exec.Command("sh", "-c", script+"\nprintf '%s\\0' "+strings.Join(show, " ")).Output()
	if err != nil {
		t.Fatalf("sh: %v\n%s", err, script)
	}
	return strings.Split(strings.TrimSuffix(string(out), "\x00"), "\x00")
}

// TestEscapeShellQuote: shellQuote's output carries nothing a terminal acts
// on, and sh reads back exactly the value.
func TestEscapeShellQuote(t *testing.T) {
	t.Parallel()
	values := append([]string{evil, "it's", "a b", "$(id)", "`id`", "back\\slash", "%d %s", "nl\nline", "plain-name:1"}, terminalHostile...)
	for _, v := range values {
		q := shellQuote(v)
		if bad, ok := termClean(q); !ok {
			t.Errorf("shellQuote(%q) = %q contains %s", v, q, bad)
		}
		if got := shellEval(t, "x="+q, "x"); len(got) != 1 || got[0] != v {
			t.Errorf("shellQuote(%q) = %s: sh reads back %q", v, q, got)
		}
	}
	if shellQuote("plain-name:1") != "plain-name:1" {
		t.Errorf("plain name quoted: %s", shellQuote("plain-name:1"))
	}
}
