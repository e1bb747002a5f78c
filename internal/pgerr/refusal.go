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

// guardToken finds the token in the DETAIL of a guard's refusal ("op OP, key
// K, row fence F, token T, lock L, ..."): the first "row fence F, token T,"
// with numbers for both.
var guardToken = regexp.MustCompile(`, row fence -?[0-9]+, token ([0-9]+),`)

// ParseGuardToken returns the token of a guard's refusal from its DETAIL,
// or 0 when it names none (a DELETE without pgfence.use_token).
func ParseGuardToken(detail string) int64 {
	m := guardToken.FindStringSubmatch(detail)
	if m == nil {
		return 0
	}
	t, err := strconv.ParseInt(m[1], 10, 64)
	if err != nil {
		return 0
	}
	return t
}
