package doccheck

import (
	"fmt"
	"regexp"
	"strings"
)

// A Block is one fenced code block of a Markdown document.
type Block struct {
	Doc       string // the document's path, as given to Extract
	FenceLine int    // 1-based line of the opening fence
	Line      int    // 1-based line of the first line of Text
	Lang      string // first word of the info string, lower case ("go", "sql", "")
	Directive string // text of a <!-- snippet: ... --> comment before the fence, "" if none
	Text      string // the block's lines, each ending in "\n"
}

// IsGo reports whether b is fenced as Go.
func (b Block) IsGo() bool { return b.Lang == "go" || b.Lang == "golang" }

// Generated reports whether b carries the generated directive.
func (b Block) Generated() bool {
	f := strings.Fields(b.Directive)
	return len(f) > 0 && f[0] == "generated"
}

func (b Block) String() string { return fmt.Sprintf("%s:%d", b.Doc, b.FenceLine) }

var (
	fenceOpen = regexp.MustCompile("^( {0,3})(`{3,}|~{3,})[ \t]*(.*)$")
	directive = regexp.MustCompile(`^\s*<!--\s*snippet:(.*?)-->\s*$`)
)

// Extract returns the fenced code blocks of a Markdown document (CommonMark
// fences: three or more backticks or tildes, indented at most three spaces).
// It fails on a fence that is never closed and on a snippet directive that is
// malformed, unknown, or not right before a ```go block.
func Extract(doc string, src []byte) ([]Block, error) {
	lines := strings.SplitAfter(string(src), "\n")
	if n := len(lines); n > 0 && lines[n-1] == "" {
		lines = lines[:n-1]
	}
	var blocks []Block
	var errs []string
	pending, pendingLine := "", 0 // a directive waiting for its block
	flush := func() {
		if pendingLine != 0 {
			errs = append(errs, fmt.Sprintf("%s:%d: snippet directive %q does not come right before a ```go block", doc, pendingLine, pending))
			pending, pendingLine = "", 0
		}
	}
	for i := 0; i < len(lines); i++ {
		line := strings.TrimRight(lines[i], "\r\n")
		if strings.Contains(line, "<!--") && strings.Contains(line, "snippet:") {
			flush()
			m := directive.FindStringSubmatch(line)
			if m == nil {
				errs = append(errs, fmt.Sprintf("%s:%d: malformed snippet directive (want <!-- snippet: generated --> alone on its line): %s", doc, i+1, line))
				continue
			}
			pending, pendingLine = strings.TrimSpace(m[1]), i+1
			if f := strings.Fields(pending); len(f) == 0 || f[0] != "generated" {
				errs = append(errs, fmt.Sprintf("%s:%d: unknown snippet directive %q (the only one is \"generated\"; a block that does not compile must be fixed, not skipped)", doc, i+1, pending))
				pending, pendingLine = "", 0
			}
			continue
		}
		m := fenceOpen.FindStringSubmatch(line)
		if m == nil || (m[2][0] == '`' && strings.Contains(m[3], "`")) {
			if strings.TrimSpace(line) != "" {
				flush()
			}
			continue
		}
		indent, fence, info := len(m[1]), m[2], strings.Fields(m[3])
		b := Block{Doc: doc, FenceLine: i + 1, Line: i + 2}
		if len(info) > 0 {
			b.Lang = strings.ToLower(info[0])
		}
		if pendingLine != 0 {
			if !b.IsGo() {
				flush()
			} else {
				b.Directive = pending
				pending, pendingLine = "", 0
			}
		}
		var text strings.Builder
		closed := false
		for i++; i < len(lines); i++ {
			l := strings.TrimRight(lines[i], "\r\n")
			if t := strings.TrimLeft(l, " "); len(l)-len(t) <= 3 && strings.HasPrefix(t, fence) &&
				strings.Trim(t, fence[:1]+" \t") == "" {
				closed = true
				break
			}
			// Content lines lose up to the fence's own indentation.
			for k := 0; k < indent && strings.HasPrefix(l, " "); k++ {
				l = l[1:]
			}
			text.WriteString(l + "\n")
		}
		if !closed {
			errs = append(errs, fmt.Sprintf("%s:%d: code fence %s is never closed", doc, b.FenceLine, fence))
			break
		}
		b.Text = text.String()
		blocks = append(blocks, b)
	}
	flush()
	if len(errs) > 0 {
		return blocks, fmt.Errorf("%s", strings.Join(errs, "\n"))
	}
	return blocks, nil
}
