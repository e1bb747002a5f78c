package fencedwrite_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/fencedwrite"
)

// TestCheckIdentifierNamesTheCharacter: a refused non-ASCII name is reported
// with the letter the user typed, not one of its UTF-8 bytes.
func TestCheckIdentifierNamesTheCharacter(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]string{
		"größe":   `'ö'`,
		"naïve":   `'ï'`,
		"tbl;x":   `';'`,
		"a\x00b":  `'\x00'`,
		"日本":      `'日'`,
		"ok_name": "",
	} {
		err := fencedwrite.CheckIdentifier("table", name)
		if want == "" {
			if err != nil {
				t.Errorf("%q: %v", name, err)
			}
			continue
		}
		var ie *fencedwrite.IdentifierError
		if !errors.As(err, &ie) || !errors.Is(err, fencedwrite.ErrInvalidIdentifier) || !strings.Contains(ie.Reason, want) {
			t.Errorf("%q: %v, want a reason naming %s", name, err, want)
		}
	}
}
