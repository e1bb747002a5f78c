package pgident

import (
	"errors"
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		reason string // "" means accepted
	}{
		{"invoices", ""},
		{"_a1", ""},
		{"Invoices", ""}, // case is kept, not folded
		{"MiXeD_Case9", ""},
		{strings.Repeat("t", 63), ""},
		{"", "empty"},
		{strings.Repeat("t", 64), "64 bytes, the limit is 63"},
		{"1a", "starts with a digit"},
		{"9", "starts with a digit"},
		{"a;drop table x", `';'`},
		{"a b", `' '`},
		{`a"b`, `'"'`},
		{"a'b", `'\''`},
		{"a\x00b", `'\x00'`},
		{"a.b", `'.'`},
		{"a-b", `'-'`},
		{"a--", `'-'`},
		{"a/*", `'/'`},
		{"a$b", `'$'`},
		{"$a", `'$'`},
		{"größe", `'ö'`},
		{"Ünïcode_t", `'Ü'`},
		{"日本", `'日'`},
		{"a\xffb", "'\ufffd'"}, // invalid UTF-8: the replacement rune
	} {
		err := Check("table", tc.name)
		if tc.reason == "" {
			if err != nil {
				t.Errorf("Check(%q) = %v, want nil", tc.name, err)
			}
			continue
		}
		var ie *Error
		if !errors.As(err, &ie) || !errors.Is(err, ErrInvalid) || !strings.Contains(ie.Reason, tc.reason) || ie.What != "table" {
			t.Errorf("Check(%q) = %#v, want an *Error whose reason contains %s", tc.name, err, tc.reason)
		}
	}
}

func TestCheckCutsLongValues(t *testing.T) {
	t.Parallel()
	var ie *Error
	if err := Check("column", strings.Repeat("x", 200)); !errors.As(err, &ie) || len(ie.Value) != 83 {
		t.Fatalf("Check = %v", err)
	}
	if got := ie.Error(); !strings.HasPrefix(got, `invalid column name "xxx`) || !strings.HasSuffix(got, "200 bytes, the limit is 63") {
		t.Fatalf("Error() = %s", got)
	}
}

func TestParseTableName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in     string
		want   TableName
		quoted string
		what   string // the part an error names; "" means accepted
	}{
		{in: "invoices", want: TableName{Name: "invoices"}, quoted: `"invoices"`},
		{in: "billing.Invoices", want: TableName{Schema: "billing", Name: "Invoices"}, quoted: `"billing"."Invoices"`},
		{in: "", what: "table"},
		{in: ".", what: "schema"},
		{in: "a.", what: "table"},
		{in: ".a", what: "schema"},
		{in: "a.b.c", what: "table"},
		{in: "a;drop table x", what: "table"},
		{in: "s;x.t", what: "schema"},
		{in: `s."t"`, what: "table"},
		{in: strings.Repeat("s", 64) + ".t", what: "schema"},
	} {
		got, err := ParseTableName(tc.in)
		if tc.what != "" {
			var ie *Error
			if !errors.As(err, &ie) || ie.What != tc.what {
				t.Errorf("ParseTableName(%q) = %v, %v; want an error about the %s", tc.in, got, err, tc.what)
			}
			continue
		}
		if err != nil || got != tc.want || got.String() != tc.quoted {
			t.Errorf("ParseTableName(%q) = %#v (%s), %v; want %#v (%s)", tc.in, got, got, err, tc.want, tc.quoted)
		}
	}
}

func TestQuote(t *testing.T) {
	t.Parallel()
	if got := Quote("s", `a"b`); got != `"s"."a""b"` {
		t.Fatalf("Quote = %s", got)
	}
}

func TestIsUniqueKey(t *testing.T) {
	t.Parallel()
	keys := [][]string{{"id"}, {"tenant", "code"}}
	for _, tc := range []struct {
		cols []string
		want bool
	}{
		{[]string{"id"}, true},
		{[]string{"code", "tenant"}, true},
		{[]string{"tenant"}, false},
		{[]string{"tenant", "code", "id"}, false},
		{nil, false},
	} {
		if got := IsUniqueKey(keys, tc.cols); got != tc.want {
			t.Errorf("IsUniqueKey(%v) = %v", tc.cols, got)
		}
	}
}

// FuzzParseTableName: an accepted name is one or two parts that each pass
// Check, contain nothing SQL could read as syntax, and quote to themselves
// in double quotes.
func FuzzParseTableName(f *testing.F) {
	for _, s := range []string{"invoices", "billing.invoices", "x; drop table y", `a"b`, "a.b.c", "", ".",
		"Ünïcode", "t--", "1a", "a\x00b", "a$b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tn, err := ParseTableName(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		want := `"` + tn.Name + `"`
		if tn.Schema != "" {
			want = `"` + tn.Schema + `".` + want
		}
		for _, part := range []string{tn.Schema, tn.Name} {
			if strings.ContainsAny(part, "\"'; -/*.\\\x00$") || len(part) > MaxBytes {
				t.Fatalf("accepted %q (part %q)", s, part)
			}
		}
		if tn.String() != want {
			t.Fatalf("quoted %q = %s, want %s", s, tn, want)
		}
	})
}
