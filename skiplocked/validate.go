package skiplocked

import (
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

func checkRef(op string, r ClaimRef) error {
	if r.JobID <= 0 || r.Token <= 0 {
		return invalid(op, "ref", "job %d token %d: both must be > 0", r.JobID, r.Token)
	}
	if r.Key == ([16]byte{}) {
		return invalid(op, "ref", "job %d token %d: no claim key (Job.ClaimKey of the claimed job; pass Job.Ref())", r.JobID, r.Token)
	}
	return nil
}

// checkName checks a queue name or holder; arg names it in the error.
func checkName(op, arg, s string, maxLen int) error {
	if s == "" {
		return invalid(op, arg, "empty")
	}
	if len(s) > maxLen {
		return invalid(op, arg, "%d bytes, at most %d", len(s), maxLen)
	}
	if !utf8.ValidString(s) {
		return invalid(op, arg, "not valid UTF-8")
	}
	if strings.IndexFunc(s, unicode.IsControl) >= 0 {
		return invalid(op, arg, "%q contains control characters", s)
	}
	return nil
}

func checkQueue(op, q string) error { return checkName(op, "queue", q, maxQueueBytes) }

func checkHolder(op, arg, w string) error { return checkName(op, arg, w, maxHolderBytes) }

func checkLimit(op, arg string, n int) error {
	if n <= 0 || n > maxBatch {
		return invalid(op, arg, "%d not in 1..%d", n, maxBatch)
	}
	return nil
}

func checkTTL(op, arg string, d time.Duration) error {
	if d < minClaimTTL || d > maxClaimTTL {
		return invalid(op, arg, "%s not in %s..%s", d, minClaimTTL, maxClaimTTL)
	}
	return nil
}

// cutError makes an error text storable: at most maxErrorLen bytes of valid
// UTF-8 (invalid bytes become "?") without NUL bytes (they become "?" too).
func cutError(s string) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", "?"), "?")
	if len(s) <= maxErrorLen {
		return s
	}
	// s is valid UTF-8: only the rune the cut splits can be invalid.
	s = s[:maxErrorLen]
	if r, size := utf8.DecodeLastRuneInString(s); r == utf8.RuneError && size <= 1 {
		i := len(s) - 1
		for i > 0 && !utf8.RuneStart(s[i]) {
			i--
		}
		s = s[:i]
	}
	return s
}
