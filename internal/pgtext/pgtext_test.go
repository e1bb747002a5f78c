package pgtext_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtext"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var texts = []struct {
	s    string
	want string // "" = stored
}{
	{"plain", ""},
	{"", ""},
	{"名前 with ünïcode and emoji 🙂", ""},
	{"x'; DROP TABLE y; --", ""},
	{"a\x00b", "contains a NUL byte"},
	{"\x00", "contains a NUL byte"},
	{"\xff", "not valid UTF-8"},
	{"ok\xc3", "not valid UTF-8"},
	{"\xed\xa0\x80", "not valid UTF-8"}, // a surrogate encoded in UTF-8
}

var docs = []struct {
	doc  string
	want string // "" = stored
}{
	{`{}`, ""},
	{`{"a":"b","n":[1,2.5,null,true],"o":{"k":"v"}}`, ""},
	{`{"a":"\\u0000"}`, ""}, // a backslash, then the text u0000
	{`{"a":"\\\\u0000"}`, ""},
	{`{"a":"\u00e9\u20ac"}`, ""},
	{`{"a":"\ud83d\ude42"}`, ""}, // a surrogate pair: 🙂
	{`{"a":"\uD83D\uDE42"}`, ""},
	{`"\t\n\"\/\b\f\r"`, ""},
	{`{"a":"\u0000"}`, `contains the escape \u0000, which jsonb does not store`},
	{`{"\u0000":1}`, `contains the escape \u0000, which jsonb does not store`},
	{`["x", "\\\u0000"]`, `contains the escape \u0000, which jsonb does not store`},
	{`{"a":"\ud800"}`, "contains a UTF-16 high surrogate escape without its low surrogate"},
	{`{"a":"\ud800x"}`, "contains a UTF-16 high surrogate escape without its low surrogate"},
	{`{"a":"\ud800\u0041"}`, "contains a UTF-16 high surrogate escape without its low surrogate"},
	{`{"a":"\udc00"}`, "contains a UTF-16 low surrogate escape without its high surrogate"},
	{"{\"a\":\"\xff\"}", "not valid UTF-8"},
}

// TestProblems checks each verdict, and that PostgreSQL agrees: a text or
// jsonb value is refused by the server exactly when a problem is reported.
func TestProblems(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	for _, c := range texts {
		if got := pgtext.Problem(c.s); got != c.want {
			t.Errorf("Problem(%q) = %q, want %q", c.s, got, c.want)
		}
		var back string
		err := pool.QueryRow(ctx, "SELECT $1::text", c.s).Scan(&back)
		if (err != nil) != (c.want != "") || (err == nil && back != c.s) {
			t.Errorf("PostgreSQL on text %q: %v (read back %q); Problem says %q", c.s, err, back, c.want)
		}
	}
	for _, c := range docs {
		if !json.Valid([]byte(c.doc)) {
			t.Fatalf("%q is not valid JSON for encoding/json: the case tests nothing", c.doc)
		}
		if got := pgtext.JSONProblem([]byte(c.doc)); got != c.want {
			t.Errorf("JSONProblem(%s) = %q, want %q", c.doc, got, c.want)
		}
		_, err := pool.Exec(ctx, "SELECT $1::text::jsonb", c.doc)
		if (err != nil) != (c.want != "") {
			t.Errorf("PostgreSQL on jsonb %s: %v; JSONProblem says %q", c.doc, err, c.want)
		}
	}
}

// TestJSONProblemLongDocument: a large valid document with many escapes is
// accepted, and one \u0000 at its end is found.
func TestJSONProblemLongDocument(t *testing.T) {
	t.Parallel()
	doc := `{"a":"` + strings.Repeat(`\\ \" \u00e9 \ud83d\ude42 `, 20000) + `"}`
	if got := pgtext.JSONProblem([]byte(doc)); got != "" {
		t.Fatalf("JSONProblem(long valid document) = %q", got)
	}
	bad := doc[:len(doc)-2] + `\u0000"}`
	if got := pgtext.JSONProblem([]byte(bad)); !strings.Contains(got, `\u0000`) {
		t.Fatalf("JSONProblem(long document ending in \\u0000) = %q", got)
	}
}
