package pgerr

import (
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
