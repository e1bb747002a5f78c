package cli

// The one printing path of the CLI. Every string pgfence prints that it did
// not write itself goes through one of these functions: strings read from
// the database (lock names, holders, metadata, role and application names,
// queue names, table and column names, key values), names the user gave
// that are echoed back, and error messages, which may carry either:
//
//   - termSafe: a value in a table or a line, quoted when it holds anything
//     a terminal would act on;
//   - termLine: free text (an error message, a note of pgfence run), with
//     each such character escaped in place; Main prints every error through
//     it, and pgfence run's notes go through notef;
//   - writeJSON: --json output;
//   - shellQuote: the shell assignments of pgfence acquire.
//
// TestEscapeEveryCommand feeds escape sequences, C1 controls and
// bidirectional controls through every command and fails for a command
// that has no case there.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// termSafe returns s for printing in a table or text output: unchanged when
// it is valid UTF-8 made of printable characters and spaces, otherwise
// quoted as a Go string literal (strconv.Quote: "\x1b[2J", "a\nb",
// "\u202e", "\xff"). Lock names, holders and metadata come from the
// database, where anyone who can take a lock can write them; printed raw, an
// escape sequence could clear the screen or retitle the terminal, a newline
// or tab could forge rows and columns, a bidirectional override could
// reorder what is shown. A value that begins with a double quote is quoted
// too, so a printed value is never ambiguous. --json output is escaped by
// the JSON encoder instead, and carries the exact value.
func termSafe(s string) string {
	if strings.HasPrefix(s, `"`) || !utf8.ValidString(s) {
		return strconv.Quote(s)
	}
	for _, r := range s {
		if r != ' ' && !strconv.IsPrint(r) {
			return strconv.Quote(s)
		}
	}
	return s
}

// termSafeOr is [termSafe] of *s, or def when s is nil.
func termSafeOr(s *string, def string) string {
	if s == nil {
		return def
	}
	return termSafe(*s)
}

// writeJSON prints v as indented JSON. Characters a terminal may act on that
// encoding/json leaves raw (DEL, C1 controls, format characters such as
// bidirectional overrides) are written as \u escapes: they can only occur
// inside JSON strings, where the escape stands for the same character, so the
// values decode exactly as stored.
func writeJSON(w io.Writer, v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	_, err := w.Write(escapeJSONControls(buf.Bytes()))
	return err
}

// escapeJSONControls rewrites the DEL, C1 control and format characters of
// JSON text produced by encoding/json (valid UTF-8, C0 controls already
// escaped) as \u escapes.
func escapeJSONControls(b []byte) []byte {
	var out []byte
	for i := 0; i < len(b); {
		r, size := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError && r != '\n' && (unicode.IsControl(r) || unicode.Is(unicode.Cf, r)) {
			if out == nil {
				out = append(make([]byte, 0, len(b)+16), b[:i]...)
			}
			if r > 0xFFFF {
				r1, r2 := utf16.EncodeRune(r)
				out = fmt.Appendf(out, `\u%04x\u%04x`, r1, r2)
			} else {
				out = fmt.Appendf(out, `\u%04x`, r)
			}
		} else if out != nil {
			out = append(out, b[i:i+size]...)
		}
		i += size
	}
	if out == nil {
		return b
	}
	return out
}

// termLine returns free text (an error message, a note) for printing: each
// character a terminal may act on (a C0 or C1 control, DEL, a format
// character such as a bidirectional control, a line or paragraph separator)
// and each invalid byte is replaced by its Go escape (\x1b, \u202e, \xff);
// everything else is kept, including newlines and tabs, which lay text out
// but change no terminal state. Values inside the text are best quoted with
// [termSafe] (or %q) first, so that they stay unambiguous.
func termLine(s string) string {
	if termPlain(s, true) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n' || r == '\t' || r == ' ' || strconv.IsPrint(r):
			b.WriteString(s[i : i+size])
		default:
			q := strconv.QuoteRune(r) // '\x1b', '\u202e'
			b.WriteString(q[1 : len(q)-1])
		}
		i += size
	}
	return b.String()
}

// termPlain reports whether s is valid UTF-8 made of printable characters
// and spaces (and, with layout, newlines and tabs).
func termPlain(s string, layout bool) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if r != ' ' && !strconv.IsPrint(r) && !(layout && (r == '\n' || r == '\t')) {
			return false
		}
	}
	return true
}

// notef writes one line to w, formatted as fmt.Fprintf and passed through
// [termLine] (pgfence run's notes carry lock names and error messages).
func notef(w io.Writer, format string, args ...any) {
	fmt.Fprintf(w, "%s\n", termLine(fmt.Sprintf(format, args...)))
}

// shellQuote quotes s as one word of a POSIX shell: unchanged when it is
// made of characters no shell treats specially, else in single quotes. A
// character a terminal would act on (a control other than newline, a format
// character, an invalid byte) is written as "$(printf '\ooo')" between the
// quoted parts, so the printed assignment carries no raw escape sequence
// and eval still gives back exactly s. (A newline stays inside the quotes:
// command substitution would drop it.)
func shellQuote(s string) string {
	safe := s != ""
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' || r == '/' || r == ':') {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	var b strings.Builder
	b.WriteByte('\'')
	var raw []byte // a run of characters to write through printf
	flush := func() {
		if len(raw) == 0 {
			return
		}
		b.WriteString(`'"$(printf '`)
		for _, c := range raw {
			fmt.Fprintf(&b, `\%03o`, c)
		}
		b.WriteString(`')"'`)
		raw = raw[:0]
	}
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1, r != '\n' && r != ' ' && !strconv.IsPrint(r):
			raw = append(raw, s[i:i+size]...)
		case r == '\'':
			flush()
			b.WriteString(`'\''`)
		default:
			flush()
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	flush()
	b.WriteByte('\'')
	return b.String()
}
