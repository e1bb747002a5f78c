package pgerr

import (
	"regexp"
	"strconv"
	"strings"
)

// ParseRefusal reads the DETAIL of pgfence.fence_refused, the refusal of a
// generated fenced statement (SQLSTATE PF003..PF007): "token N, fence N,
// table T, key K" (fence NULL, read as 0, when there was no row). Zeros and
// empty strings when detail is not one.
func ParseRefusal(detail string) (token, fence int64, table, key string) {
	rest, ok := strings.CutPrefix(detail, "token ")
	if !ok {
		return 0, 0, "", ""
	}
	tok, rest, _ := strings.Cut(rest, ", fence ")
	fen, rest, _ := strings.Cut(rest, ", table ")
	table, key, _ = strings.Cut(rest, ", key ")
	token, _ = strconv.ParseInt(tok, 10, 64)
	fence, _ = strconv.ParseInt(fen, 10, 64)
	return token, fence, table, key
}

// guardToken finds the token in the message of a guard's refusal ("pgfence
// guard: UPDATE of s.t carries token T but lock ...", "pgfence guard:
// DELETE from s.t with stale token T (row fence F)"). The message, not the
// DETAIL: the DETAIL begins with the row's key, whose values any writer
// chooses, and a key could hold text that reads like a token; the table's
// name, before the token in the message, is its owner's, written unquoted
// (it may hold spaces, even a newline). The shortest name that fits is
// taken: the lock name after the token is a writer's and could hold the
// phrase again.
var guardToken = regexp.MustCompile(`^(?s)pgfence guard: (?:(?:INSERT|UPDATE|DELETE) of .+? carries token ([0-9]+) but lock |DELETE from .+? with stale token ([0-9]+) \(row fence )`)

// ParseGuardToken returns the token of a guard's refusal from its message,
// or 0 when it names none (a write that carries no token).
func ParseGuardToken(message string) int64 {
	m := guardToken.FindStringSubmatch(message)
	if m == nil {
		return 0
	}
	t, err := strconv.ParseInt(m[1]+m[2], 10, 64)
	if err != nil {
		return 0
	}
	return t
}
