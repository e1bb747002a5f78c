// Package pgtext says why PostgreSQL would refuse a string as text or a JSON
// document as jsonb, so that callers refuse it first with a typed error
// instead of sending it and getting an untyped one from the server.
package pgtext

import (
	"strings"
	"unicode/utf8"
)

// Problem returns why a text column of a UTF-8 database refuses s, or "":
// PostgreSQL stores no invalid UTF-8 (SQLSTATE 22021) and no NUL byte.
func Problem(s string) string {
	switch {
	case !utf8.ValidString(s):
		return "not valid UTF-8"
	case strings.IndexByte(s, 0) >= 0:
		return "contains a NUL byte"
	}
	return ""
}

// JSONProblem returns why a jsonb column refuses the JSON document b, or "".
// b must already be valid JSON (encoding/json's Valid): Go accepts, and
// jsonb refuses, invalid UTF-8 inside strings, the escape \u0000 (SQLSTATE
// 22P05) and a UTF-16 surrogate escape without its pair (22P02).
func JSONProblem(b []byte) string {
	if !utf8.Valid(b) {
		return "not valid UTF-8"
	}
	inString := false
	for i := 0; i < len(b); i++ {
		c := b[i]
		if !inString {
			inString = c == '"'
			continue
		}
		switch c {
		case '"':
			inString = false
		case '\\':
			if i+1 >= len(b) || b[i+1] != 'u' {
				i++ // a one-character escape
				continue
			}
			r, ok := hex4(b, i+2)
			if !ok {
				return "" // not valid JSON: the caller's check reports it
			}
			switch {
			case r == 0:
				return `contains the escape \u0000, which jsonb does not store`
			case r >= 0xDC00 && r <= 0xDFFF:
				return "contains a UTF-16 low surrogate escape without its high surrogate"
			case r >= 0xD800 && r <= 0xDBFF:
				if i+7 < len(b) && b[i+6] == '\\' && b[i+7] == 'u' {
					if r2, ok := hex4(b, i+8); ok && r2 >= 0xDC00 && r2 <= 0xDFFF {
						i += 11
						continue
					}
				}
				return "contains a UTF-16 high surrogate escape without its low surrogate"
			}
			i += 5
		}
	}
	return ""
}

// hex4 decodes the four hex digits at b[i:i+4].
func hex4(b []byte, i int) (rune, bool) {
	if i+4 > len(b) {
		return 0, false
	}
	var r rune
	for _, c := range b[i : i+4] {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c-'a') + 10
		case c >= 'A' && c <= 'F':
			r |= rune(c-'A') + 10
		default:
			return 0, false
		}
	}
	return r, true
}
