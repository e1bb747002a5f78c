package skiplocked

import (
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

func checkRef(r ClaimRef) error {
	if r.JobID <= 0 || r.Token <= 0 {
		return fmt.Errorf("%w: job %d token %d", ErrInvalidToken, r.JobID, r.Token)
	}
	if r.Key == ([16]byte{}) {
		return fmt.Errorf("%w: job %d token %d: no claim key (Job.ClaimKey of the claimed job; pass Job.Ref())",
			ErrInvalidToken, r.JobID, r.Token)
	}
	return nil
}

func checkName(s string, maxLen int, sentinel error) error {
	if s == "" {
		return fmt.Errorf("%w: empty", sentinel)
	}
	if len(s) > maxLen {
		return fmt.Errorf("%w: %d bytes, at most %d", sentinel, len(s), maxLen)
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: not valid UTF-8", sentinel)
	}
	if strings.IndexFunc(s, unicode.IsControl) >= 0 {
		return fmt.Errorf("%w: %q contains control characters", sentinel, s)
	}
	return nil
}

func checkQueue(q string) error { return checkName(q, maxQueueBytes, ErrInvalidQueue) }

func checkHolder(w string) error { return checkName(w, maxHolderBytes, ErrInvalidHolder) }

func checkLimit(n int) error {
	if n <= 0 || n > maxBatch {
		return fmt.Errorf("%w: %d not in 1..%d", ErrInvalidLimit, n, maxBatch)
	}
	return nil
}

func checkTTL(d time.Duration) error {
	if d < minClaimTTL || d > maxClaimTTL {
		return fmt.Errorf("%w: %s not in %s..%s", ErrInvalidTTL, d, minClaimTTL, maxClaimTTL)
	}
	return nil
}

func cutError(s string) string {
	if len(s) <= maxErrorLen {
		return strings.ToValidUTF8(s, "?")
	}
	s = s[:maxErrorLen]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}
