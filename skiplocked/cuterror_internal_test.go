package skiplocked

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// cutError keeps maxErrorLen bytes of a long error text whatever its
// invalid bytes, NULs and multi-byte runes: before, one invalid byte in a
// text over the limit cut everything after it (and took quadratic time).
func TestCutError(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 2*maxErrorLen)
	for _, c := range []struct {
		name string
		in   string
		want int // length of the result
	}{
		{"short with NUL and invalid", "a\x00b\xffc", 5},
		{"long, invalid byte first", "\xff" + long, maxErrorLen},
		{"long, NUL first", "\x00" + long, maxErrorLen},
		{"long, 3-byte rune split by the cut", strings.Repeat("x", maxErrorLen-1) + "€" + long, maxErrorLen - 1},
		{"long, 3-byte rune ends at the cut", strings.Repeat("x", maxErrorLen-3) + "€" + long, maxErrorLen},
		{"long, U+FFFD at the cut", strings.Repeat("x", maxErrorLen-3) + "\uFFFD" + long, maxErrorLen},
		{"long, 2-byte runes", strings.Repeat("é", maxErrorLen), maxErrorLen},
	} {
		got := cutError(c.in)
		if len(got) != c.want || !utf8.ValidString(got) || strings.ContainsRune(got, 0) {
			t.Errorf("%s: %d bytes (valid %v, NUL %v), want %d valid bytes without NUL",
				c.name, len(got), utf8.ValidString(got), strings.ContainsRune(got, 0), c.want)
		}
	}
}
