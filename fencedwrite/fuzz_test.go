package fencedwrite_test

import (
	"strings"
	"testing"

	"github.com/pgfence/pgfence/fencedwrite"
)

// FuzzParseTableName: whatever the input, an accepted name is one or two
// plain identifiers, and its quoted form is exactly those parts in quotes.
func FuzzParseTableName(f *testing.F) {
	for _, s := range []string{"invoices", "billing.invoices", "x; drop table y", `a"b`, "a.b.c", "", ".", "a.",
		"Ünïcode", "t--", "t/*", strings.Repeat("x", 64), "_a1", "1a", "a b", "a\x00b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tn, err := fencedwrite.ParseTableName(s)
		if err != nil {
			return
		}
		for _, part := range []string{tn.Schema, tn.Name} {
			if strings.ContainsAny(part, "\"'; -/*.\\\x00") || len(part) > fencedwrite.MaxIdentifierBytes {
				t.Fatalf("accepted %q (part %q)", s, part)
			}
		}
		want := `"` + tn.Name + `"`
		if tn.Schema != "" {
			want = `"` + tn.Schema + `".` + want
		}
		if tn.String() != want {
			t.Fatalf("quoted %q = %s, want %s", s, tn.String(), want)
		}
	})
}
