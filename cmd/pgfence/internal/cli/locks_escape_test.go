package cli

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// terminalHostile are lock names and holders that misbehave when printed raw:
// escape sequences (clear screen, set window title, cursor moves), C1
// controls, line breaks that forge rows, tabs that forge columns, a
// bidirectional override, invalid UTF-8, and a value that looks quoted.
var terminalHostile = []string{
	"\x1b[2J\x1b[H",             // clear screen, cursor home
	"\x1b]0;pwned\x07",          // window title (OSC ... BEL)
	"\x1b]0;pwned\x1b\\",        // window title (OSC ... ST)
	"name\nforged\theld\tx\t99", // a forged table row
	"a\rb",                      // carriage return: overwrite the line
	"tab\tbed",                  // a forged column
	"del\x7f",                   // DEL
	"c1\u009b2J",                // CSI as a C1 control (U+009B)
	"bidi\u202egnp.exe",         // right-to-left override
	"line\u2028separator",       // Unicode line separator
	"bad\xffutf8",               // invalid UTF-8
	`"already quoted"`,          // ambiguous if printed raw
	"bell\a",                    // BEL
	"tag\U000E0041",             // a tag character (format, outside the BMP)
	"soh \x01\x02\x03 stx",      // other C0 controls
}

// termClean reports the first rune of out that a terminal would act on: a
// control character other than newline, a format character (bidi), a
// line or paragraph separator, or an invalid byte. ok is true if none.
func termClean(out string) (bad string, ok bool) {
	if !utf8.ValidString(out) {
		return "invalid UTF-8", false
	}
	for _, r := range out {
		if r == '\n' {
			continue
		}
		if unicode.IsControl(r) || unicode.Is(unicode.Cf, r) || r == '\u2028' || r == '\u2029' {
			return strconv.QuoteRune(r), false
		}
	}
	return "", true
}

func TestEscapeTermSafe(t *testing.T) {
	t.Parallel()
	for _, s := range terminalHostile {
		got := termSafe(s)
		if bad, ok := termClean(got); !ok {
			t.Errorf("termSafe(%q) = %q still contains %s", s, got, bad)
		}
		back, err := strconv.Unquote(got)
		if err != nil || back != s {
			t.Errorf("termSafe(%q) = %s does not unquote to the value: %q %v", s, got, back, err)
		}
	}
	for _, s := range []string{"invoice:42", "host/1/a", "held", "é🔒 lock", "name with spaces", `{"job": 42}`, "a\"b", ""} {
		if got := termSafe(s); got != s {
			t.Errorf("termSafe(%q) = %q, want it unchanged", s, got)
		}
	}
	if got := termSafeOr(nil, "-"); got != "-" {
		t.Errorf("termSafeOr(nil) = %q", got)
	}
	// One of the plain values (used as a control below).
	if termSafe("n0") != "n0" {
		t.Fatal("plain name quoted")
	}
	for _, s := range terminalHostile {
		if strings.HasPrefix(s, "bad") {
			continue
		}
		if termSafe("n0"+s) == "n0"+s && s != `"already quoted"` {
			t.Errorf("termSafe leaves %q as is", "n0"+s)
		}
	}
}

// TestEscapeJSON: writeJSON escapes what encoding/json leaves raw (DEL, C1
// controls, format characters), and the JSON still decodes to the values.
func TestEscapeJSON(t *testing.T) {
	t.Parallel()
	var valid []string
	for _, s := range terminalHostile {
		if utf8.ValidString(s) {
			valid = append(valid, s)
		}
	}
	var buf strings.Builder
	if err := writeJSON(&buf, map[string]any{"values": valid, "raw": json.RawMessage(`{"m": "del\u007f c1\u009b"}`)}); err != nil {
		t.Fatal(err)
	}
	if bad, ok := termClean(buf.String()); !ok {
		t.Fatalf("writeJSON output contains %s:\n%q", bad, buf.String())
	}
	var back struct {
		Values []string
	}
	if err := json.Unmarshal([]byte(buf.String()), &back); err != nil {
		t.Fatal(err)
	}
	if strings.Join(back.Values, "|") != strings.Join(valid, "|") {
		t.Fatalf("values changed:\n%q\n%q", back.Values, valid)
	}
	if plain := []byte("{\n  \"a\": \"é🔒\"\n}\n"); string(escapeJSONControls(plain)) != string(plain) {
		t.Fatalf("escapeJSONControls changed plain JSON: %q", escapeJSONControls(plain))
	}
}

// TestEscapeLocksOutput stores hostile names, holders and metadata in
// pgfence.locks and checks that `pgfence locks` and `pgfence locks show`
// print them quoted (one table row per lock, nothing a terminal acts on),
// while --json still carries the exact values.
func TestEscapeLocksOutput(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	var names []string
	for i, s := range terminalHostile {
		if !utf8.ValidString(s) {
			continue // PostgreSQL stores valid UTF-8 only
		}
		name, holder := "n"+strconv.Itoa(i)+s, "h"+strconv.Itoa(i)+s
		// metadata: a JSON string with the raw value (jsonb escapes C0
		// controls itself, but not DEL, C1 controls or U+202E).
		meta, err := json.Marshal(map[string]string{"note": s})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `INSERT INTO pgfence.locks (name, token, holder, acquired_at, expires_at, metadata)
			VALUES ($1, $2, $3, now(), now() + interval '1 hour', $4)`, name, i+1, holder, meta); err != nil {
			t.Fatal(err)
		}
		names = append(names, name)
	}

	r := run(t, dsn, "locks")
	if r.code != 0 {
		t.Fatalf("locks: %+v", r)
	}
	if bad, ok := termClean(r.stdout); !ok {
		t.Fatalf("locks output contains %s:\n%q", bad, r.stdout)
	}
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	if len(lines) != len(names)+1 {
		t.Fatalf("locks printed %d lines for %d locks:\n%s", len(lines), len(names), r.stdout)
	}
	for _, n := range names {
		if !strings.Contains(r.stdout, termSafe(n)) {
			t.Errorf("locks output lacks the name as %s", termSafe(n))
		}
	}

	for i, n := range names {
		r := run(t, dsn, "locks", "show", n)
		if r.code != 0 {
			t.Fatalf("locks show %q: %+v", n, r)
		}
		if bad, ok := termClean(r.stdout); !ok {
			t.Errorf("locks show %q output contains %s:\n%q", n, bad, r.stdout)
		}
		if !strings.Contains(r.stdout, "name:") || !strings.Contains(r.stdout, termSafe(n)) {
			t.Errorf("locks show %q: no quoted name in\n%s", n, r.stdout)
		}
		if i == 0 && strings.Count(r.stdout, "\n") != 10 {
			t.Errorf("locks show printed %d lines:\n%s", strings.Count(r.stdout, "\n"), r.stdout)
		}
	}

	// --json: exact values, escaped by the encoder.
	r = run(t, dsn, "locks", "--json")
	if bad, ok := termClean(r.stdout); !ok {
		t.Fatalf("locks --json output contains %s", bad)
	}
	var views []lockView
	if err := json.Unmarshal([]byte(r.stdout), &views); err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, v := range views {
		got[v.Name] = true
		var meta map[string]string
		if err := json.Unmarshal(v.Metadata, &meta); err != nil || !strings.HasSuffix(v.Name, meta["note"]) ||
			v.Holder == nil || !strings.HasSuffix(*v.Holder, meta["note"]) {
			t.Errorf("locks --json: holder or metadata not exact: %+v (%v)", v, err)
		}
	}
	for _, n := range names {
		if !got[n] {
			t.Errorf("locks --json lacks %q", n)
		}
	}

	// A missing lock with a hostile name: the error quotes it.
	r = run(t, dsn, "locks", "show", "\x1b[2Jmissing")
	if r.code != ExitNotFound {
		t.Fatalf("show missing: %+v", r)
	}
	if bad, ok := termClean(r.stderr); !ok {
		t.Errorf("show missing: stderr contains %s: %q", bad, r.stderr)
	}
}

// TestEscapeFencesOutput: keys and lock names read from a fenced table are
// printed quoted, so they cannot drive the terminal or forge table rows.
func TestEscapeFencesOutput(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := pool.Exec(ctx, `CREATE TABLE hostile (k text PRIMARY KEY, lock text NOT NULL, fence bigint NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	rows := 0
	for i, s := range terminalHostile {
		if !utf8.ValidString(s) {
			continue
		}
		if _, err := pool.Exec(ctx, `INSERT INTO hostile VALUES ($1, $2, 0)`, "k"+strconv.Itoa(i)+s, "l"+s); err != nil {
			t.Fatal(err)
		}
		rows++
	}
	r := run(t, dsn, "fences", "--table", "hostile", "--key", "k", "--lock-column", "lock")
	if bad, ok := termClean(r.stdout); !ok {
		t.Fatalf("fences output contains %s:\n%q", bad, r.stdout)
	}
	if lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n"); len(lines) != rows+1 {
		t.Fatalf("fences printed %d lines for %d rows:\n%s", len(lines), rows, r.stdout)
	}
}
