package deploycheck

import (
	"fmt"
	"strings"
	"unicode"
)

// use is one metric named in a PromQL expression.
type use struct {
	name   string   // as written: a histogram's series carry _bucket, _sum or _count
	labels []string // label names of its matchers
	fn     string   // innermost function or aggregation it is an argument of ("" if none)
}

// parsed is what an expression references.
type parsed struct {
	metrics  []use
	grouping []string // label names of by/without/on/ignoring/group_left/group_right lists
}

// functions are the PromQL functions and aggregations the assets may use; an
// unknown name is an error, so a typo does not pass for a metric.
var functions = map[string]bool{
	"sum": true, "max": true, "min": true, "avg": true, "count": true, "topk": true, "bottomk": true,
	"rate": true, "irate": true, "increase": true, "delta": true, "deriv": true,
	"histogram_quantile": true, "abs": true, "clamp_min": true, "clamp_max": true, "absent": true,
	"max_over_time": true, "min_over_time": true, "time": true, "vector": true, "scalar": true,
}

var keywords = map[string]bool{
	"and": true, "or": true, "unless": true, "bool": true, "offset": true,
}

var groupers = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

// parsePromQL lists the metrics, their matchers' label names and the grouping
// labels of expr. It is a scanner for the expressions of pgfence's assets,
// not a full PromQL parser: promtool checks the syntax.
func parsePromQL(expr string) (parsed, error) {
	var p parsed
	rs := []rune(expr)
	i := 0
	var stack []string // function names of the open parentheses
	skipSpace := func() {
		for i < len(rs) && unicode.IsSpace(rs[i]) {
			i++
		}
	}
	ident := func() string {
		start := i
		for i < len(rs) && (rs[i] == '_' || rs[i] == ':' || unicode.IsLetter(rs[i]) || unicode.IsDigit(rs[i])) {
			i++
		}
		return string(rs[start:i])
	}
	str := func() error { // at a quote: skip the string literal
		q := rs[i]
		for i++; i < len(rs); i++ {
			if rs[i] == '\\' && q != '`' {
				i++
				continue
			}
			if rs[i] == q {
				i++
				return nil
			}
		}
		return fmt.Errorf("unterminated string in %q", expr)
	}
	labelList := func() ([]string, error) { // at '(': a list of label names
		var out []string
		for i++; ; {
			skipSpace()
			if i >= len(rs) {
				return nil, fmt.Errorf("unterminated label list in %q", expr)
			}
			switch {
			case rs[i] == ')':
				i++
				return out, nil
			case rs[i] == ',':
				i++
			default:
				name := ident()
				if name == "" {
					return nil, fmt.Errorf("unexpected %q in a label list of %q", rs[i], expr)
				}
				out = append(out, name)
			}
		}
	}
	matchers := func() ([]string, error) { // at '{': label matchers
		var out []string
		for i++; ; {
			skipSpace()
			if i >= len(rs) {
				return nil, fmt.Errorf("unterminated matchers in %q", expr)
			}
			switch {
			case rs[i] == '}':
				i++
				return out, nil
			case rs[i] == ',':
				i++
			case rs[i] == '"' || rs[i] == '\'' || rs[i] == '`':
				if err := str(); err != nil {
					return nil, err
				}
			case strings.ContainsRune("=!~", rs[i]):
				i++
			default:
				name := ident()
				if name == "" {
					return nil, fmt.Errorf("unexpected %q in matchers of %q", rs[i], expr)
				}
				out = append(out, name)
			}
		}
	}
	for i < len(rs) {
		c := rs[i]
		switch {
		case unicode.IsSpace(c):
			i++
		case c == '"' || c == '\'' || c == '`':
			if err := str(); err != nil {
				return p, err
			}
		case c == '[': // a range or subquery: durations only
			for i < len(rs) && rs[i] != ']' {
				i++
			}
			i++
		case c == '(':
			stack = append(stack, "")
			i++
		case c == ')':
			if len(stack) == 0 {
				return p, fmt.Errorf("unbalanced ) in %q", expr)
			}
			stack = stack[:len(stack)-1]
			i++
		case unicode.IsDigit(c) || c == '.' && i+1 < len(rs) && unicode.IsDigit(rs[i+1]):
			for i < len(rs) && (unicode.IsDigit(rs[i]) || unicode.IsLetter(rs[i]) || rs[i] == '.' ||
				(rs[i] == '+' || rs[i] == '-') && (rs[i-1] == 'e' || rs[i-1] == 'E')) {
				i++
			}
		case c == '_' || c == ':' || unicode.IsLetter(c):
			name := ident()
			skipSpace()
			next := rune(0)
			if i < len(rs) {
				next = rs[i]
			}
			switch {
			case groupers[name]:
				if next != '(' {
					return p, fmt.Errorf("%s without a label list in %q", name, expr)
				}
				ls, err := labelList()
				if err != nil {
					return p, err
				}
				p.grouping = append(p.grouping, ls...)
			case keywords[name]:
			case functions[name] && next != '(' && startsGrouping(rs[i:]):
				// An aggregation with its grouping first: sum by (a) (...).
				g := ident()
				skipSpace()
				if i >= len(rs) || rs[i] != '(' || !(g == "by" || g == "without") {
					return p, fmt.Errorf("%s %s: want by (...) or without (...) in %q", name, g, expr)
				}
				ls, err := labelList()
				if err != nil {
					return p, err
				}
				p.grouping = append(p.grouping, ls...)
				skipSpace()
				if i >= len(rs) || rs[i] != '(' {
					return p, fmt.Errorf("%s without arguments in %q", name, expr)
				}
				stack = append(stack, name)
				i++
			case next == '(':
				if !functions[name] {
					return p, fmt.Errorf("unknown function %s in %q", name, expr)
				}
				stack = append(stack, name)
				i++
			default:
				u := use{name: name}
				for j := len(stack) - 1; j >= 0; j-- {
					if stack[j] != "" {
						u.fn = stack[j]
						break
					}
				}
				if next == '{' {
					ls, err := matchers()
					if err != nil {
						return p, err
					}
					u.labels = ls
				}
				p.metrics = append(p.metrics, u)
			}
		default: // operators, commas
			i++
		}
	}
	if len(stack) != 0 {
		return p, fmt.Errorf("unbalanced ( in %q", expr)
	}
	return p, nil
}

// startsGrouping reports whether rs starts with "by" or "without" followed by
// a space or '('.
func startsGrouping(rs []rune) bool {
	for _, kw := range []string{"by", "without"} {
		if strings.HasPrefix(string(rs), kw) && len(rs) > len(kw) && (rs[len(kw)] == '(' || unicode.IsSpace(rs[len(kw)])) {
			return true
		}
	}
	return false
}
