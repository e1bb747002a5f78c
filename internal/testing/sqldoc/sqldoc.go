// Package sqldoc reads the directives of docs/sql.md, the SQL reference, so
// that its test can run every psql block of it against a fresh database as
// the roles the document names.
//
// Every fenced code block of the document carries a directive: an HTML
// comment alone on a line before its opening fence (blank lines may come
// between):
//
//	<!-- sql: run as=app expect="released | t" -->
//	<!-- sql: fails=PF003 as=app expect="stale token" -->
//	<!-- sql: run as=owner -->
//	<!-- sql: skip="pseudo-code, not SQL" -->
//
// The words:
//
//   - run: the block is fed to psql with ON_ERROR_STOP and must succeed.
//   - fails=SQLSTATE: the block is fed to psql with ON_ERROR_STOP and must
//     stop with that SQLSTATE at its last statement (a statement after the
//     failure would never run).
//   - skip="reason": the block is not run; the reason is required.
//   - as=app (the default) or as=owner: the role psql connects as. app is
//     the role created from docs/migrations.md's grants; owner is the role
//     that ran the migrations, for set-up a user does as the owner (CREATE
//     TABLE of a user's own table, GRANT on it, attaching a guard).
//   - expect="text", repeatable: a line of psql's output must contain text,
//     both compared with runs of white space collapsed to one space (so
//     `expect="t | f"` matches the aligned row " t        | f").
//
// Exactly one of run, fails and skip is given. Only ```sql and ```psql
// blocks may be run; a block in another language must be skipped.
package sqldoc

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/pgfence/pgfence/internal/testing/doccheck"
)

// A Step is one code block of the document with its directive.
type Step struct {
	Block  doccheck.Block
	Skip   string   // why the block is not run; "" when it is run
	As     string   // "app" or "owner"
	Fails  string   // the SQLSTATE the block must stop with; "" when it must succeed
	Expect []string // texts that lines of the output must contain, white space collapsed
}

func (s Step) String() string { return s.Block.String() }

var (
	directiveLine = regexp.MustCompile(`^\s*<!--\s*sql:(.*?)-->\s*$`)
	word          = regexp.MustCompile(`^([a-z]+)(?:=("(?:[^"\\]|\\.)*"|[^\s"]+))?(?:\s+|$)`)
	sqlState      = regexp.MustCompile(`^[0-9A-Z]{5}$`)
)

// Parse returns the steps of a Markdown document: every fenced code block
// with its directive. It fails on a block without a directive, a malformed
// directive and a directive that does not come right before a block.
func Parse(doc string, src []byte) ([]Step, error) {
	blocks, err := doccheck.Extract(doc, src)
	if err != nil {
		return nil, err
	}
	lines := strings.Split(strings.ReplaceAll(string(src), "\r\n", "\n"), "\n")
	var errs []string
	used := map[int]bool{} // directive lines (0-based) that belong to a block
	var steps []Step
	for _, b := range blocks {
		i := b.FenceLine - 2 // the line before the fence, 0-based
		for i >= 0 && strings.TrimSpace(lines[i]) == "" {
			i--
		}
		var m []string
		if i >= 0 {
			m = directiveLine.FindStringSubmatch(lines[i])
		}
		if m == nil {
			errs = append(errs, fmt.Sprintf("%s: block without a directive: put <!-- sql: run as=app -->, "+
				"<!-- sql: fails=SQLSTATE --> or <!-- sql: skip=\"why\" --> on the line before its fence", b))
			continue
		}
		used[i] = true
		s, err := parseDirective(strings.TrimSpace(m[1]))
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s:%d: %v", doc, i+1, err))
			continue
		}
		s.Block = b
		if s.Skip == "" && b.Lang != "sql" && b.Lang != "psql" {
			errs = append(errs, fmt.Sprintf("%s: only ```sql and ```psql blocks can be run, this one is %q: skip it with a reason", b, b.Lang))
			continue
		}
		steps = append(steps, s)
	}
	for i, l := range lines {
		if strings.Contains(l, "<!--") && strings.Contains(l, "sql:") && !used[i] {
			errs = append(errs, fmt.Sprintf("%s:%d: sql directive that does not come right before a code block: %s", doc, i+1, strings.TrimSpace(l)))
		}
	}
	if len(errs) > 0 {
		return steps, fmt.Errorf("%s", strings.Join(errs, "\n"))
	}
	return steps, nil
}

// parseDirective reads the words of one directive (the text after "sql:").
func parseDirective(text string) (Step, error) {
	s := Step{As: "app"}
	kinds := 0
	asGiven := false
	for rest := text; rest != ""; {
		m := word.FindStringSubmatch(rest)
		if m == nil {
			return s, fmt.Errorf("malformed sql directive %q at %q (want words such as run, fails=PF003, as=owner, expect=\"t | f\", skip=\"why\")", text, rest)
		}
		rest = rest[len(m[0]):]
		key, val := m[1], m[2]
		hasVal := val != ""
		if strings.HasPrefix(val, `"`) {
			v, err := strconv.Unquote(val)
			if err != nil {
				return s, fmt.Errorf("sql directive %q: %s: %v", text, val, err)
			}
			val = v
		}
		switch key {
		case "run":
			if hasVal {
				return s, fmt.Errorf("sql directive %q: run takes no value", text)
			}
			kinds++
		case "fails":
			if !sqlState.MatchString(val) {
				return s, fmt.Errorf("sql directive %q: fails needs a SQLSTATE of five digits or capital letters, got %q", text, val)
			}
			s.Fails = val
			kinds++
		case "skip":
			if strings.TrimSpace(val) == "" {
				return s, fmt.Errorf("sql directive %q: skip needs a reason, skip=\"why\"", text)
			}
			s.Skip = val
			kinds++
		case "as":
			if val != "app" && val != "owner" {
				return s, fmt.Errorf("sql directive %q: as must be app or owner, got %q", text, val)
			}
			s.As, asGiven = val, true
		case "expect":
			if strings.TrimSpace(val) == "" {
				return s, fmt.Errorf("sql directive %q: expect needs a text", text)
			}
			s.Expect = append(s.Expect, Collapse(val))
		default:
			return s, fmt.Errorf("sql directive %q: unknown word %q", text, key)
		}
	}
	if kinds != 1 {
		return s, fmt.Errorf("sql directive %q: give exactly one of run, fails=SQLSTATE and skip=\"why\"", text)
	}
	if s.Skip != "" && (asGiven || len(s.Expect) > 0) {
		return s, fmt.Errorf("sql directive %q: a skipped block takes no as or expect", text)
	}
	return s, nil
}

// Collapse trims s and replaces every run of white space in it by one space.
func Collapse(s string) string { return strings.Join(strings.Fields(s), " ") }

// Missing returns the expected texts that no line of out contains, lines and
// texts compared with white space collapsed.
func Missing(out string, expect []string) []string {
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		lines = append(lines, Collapse(l))
	}
	var missing []string
	for _, e := range expect {
		found := false
		for _, l := range lines {
			if strings.Contains(l, e) {
				found = true
				break
			}
		}
		if !found {
			missing = append(missing, e)
		}
	}
	return missing
}

// LastStatementLine returns the 1-based line of text on which its last
// statement ends: the last line that is neither blank nor only a "--"
// comment. 0 when there is none.
func LastStatementLine(text string) int {
	lines := strings.Split(text, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if t := strings.TrimSpace(lines[i]); t != "" && !strings.HasPrefix(t, "--") {
			return i + 1
		}
	}
	return 0
}
