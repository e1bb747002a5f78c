package doccheck

import (
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode"
)

// A Link is one link of a Markdown document, outside code.
type Link struct {
	Doc    string // the document's path, as given to Links
	Line   int    // 1-based line of the link
	Target string // the destination as written: "guide.md#keys", "#layout", "https://..."
}

func (l Link) String() string { return fmt.Sprintf("%s:%d", l.Doc, l.Line) }

var (
	// inlineLink matches [text](dest) and ![alt](dest), with an optional
	// title; dest may be wrapped in <>.
	inlineLink = regexp.MustCompile(`!?\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:"[^"]*"|'[^']*'))?\s*\)`)
	// refDef matches a link reference definition: [label]: dest.
	refDef = regexp.MustCompile(`^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)`)
	// htmlAnchor matches an explicit anchor in HTML: id="x" or name="x".
	htmlAnchor = regexp.MustCompile(`<[a-zA-Z][^>]*\b(?:id|name)\s*=\s*"([^"]+)"`)
	// atxHeading matches "## Title" (up to three spaces of indentation).
	atxHeading = regexp.MustCompile(`^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$`)
	// setextUnderline matches the line under a setext heading.
	setextUnderline = regexp.MustCompile(`^ {0,3}(=+|-+)[ \t]*$`)
	// scheme matches the start of an absolute URL (https:, mailto:).
	scheme = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

// proseLines returns the lines of a Markdown document with fenced code
// blocks, HTML comments and inline code spans replaced by blanks, so that
// neither links nor headings are found inside code. Line numbers are kept.
func proseLines(src []byte) []string {
	lines := strings.Split(strings.ReplaceAll(string(src), "\r\n", "\n"), "\n")
	out := make([]string, len(lines))
	fence := ""      // the open code fence, "" outside code
	comment := false // inside an HTML comment
	for i, line := range lines {
		if fence != "" {
			if t := strings.TrimLeft(line, " "); len(line)-len(t) <= 3 && strings.HasPrefix(t, fence) &&
				strings.Trim(t, fence[:1]+" \t") == "" {
				fence = ""
			}
			continue
		}
		if !comment {
			if m := fenceOpen.FindStringSubmatch(line); m != nil && (m[2][0] != '`' || !strings.Contains(m[3], "`")) {
				fence = m[2]
				continue
			}
		}
		var b strings.Builder
		for line != "" {
			if comment {
				end := strings.Index(line, "-->")
				if end < 0 {
					line = ""
					break
				}
				line, comment = line[end+3:], false
				continue
			}
			start := strings.Index(line, "<!--")
			if start < 0 {
				b.WriteString(line)
				break
			}
			b.WriteString(line[:start])
			line, comment = line[start+4:], true
		}
		out[i] = blankCodeSpans(b.String())
	}
	return out
}

// blankCodeSpans replaces the text of every inline code span of line (a run
// of backticks up to the next run of the same length) by spaces.
func blankCodeSpans(line string) string {
	b := []byte(line)
	for i := 0; i < len(b); {
		if b[i] != '`' {
			i++
			continue
		}
		n := 0
		for i+n < len(b) && b[i+n] == '`' {
			n++
		}
		closeAt := -1
		for j := i + n; j < len(b); {
			if b[j] != '`' {
				j++
				continue
			}
			m := 0
			for j+m < len(b) && b[j+m] == '`' {
				m++
			}
			if m == n {
				closeAt = j
				break
			}
			j += m
		}
		if closeAt < 0 {
			i += n
			continue
		}
		for k := i + n; k < closeAt; k++ {
			b[k] = ' '
		}
		i = closeAt + n
	}
	return string(b)
}

// Links returns the links of a Markdown document: inline links and images,
// and link reference definitions, outside code blocks, code spans and HTML
// comments.
func Links(doc string, src []byte) []Link {
	var links []Link
	for i, line := range proseLines(src) {
		if m := refDef.FindStringSubmatch(line); m != nil {
			links = append(links, Link{Doc: doc, Line: i + 1, Target: strings.Trim(m[1], "<>")})
			continue
		}
		for _, m := range inlineLink.FindAllStringSubmatch(line, -1) {
			links = append(links, Link{Doc: doc, Line: i + 1, Target: strings.Trim(m[1], "<>")})
		}
	}
	return links
}

// Anchors returns the anchors a Markdown document defines: the one GitHub
// derives from each heading (see [Slug]; a repeated heading gets "-1", "-2",
// ...) and explicit HTML id and name attributes.
func Anchors(src []byte) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	add := func(heading string) {
		s := Slug(heading)
		if n, ok := seen[s]; ok {
			seen[s] = n + 1
			s += "-" + strconv.Itoa(n+1)
		} else {
			seen[s] = 0
		}
		anchors[s] = true
	}
	lines := proseLines(src)
	raw := strings.Split(strings.ReplaceAll(string(src), "\r\n", "\n"), "\n")
	for i, line := range lines {
		for _, m := range htmlAnchor.FindAllStringSubmatch(line, -1) {
			anchors[m[1]] = true
		}
		if m := atxHeading.FindStringSubmatch(line); m != nil {
			// The heading's text as written (code spans included), without a
			// closing sequence of #.
			_, text, _ := strings.Cut(strings.TrimSpace(raw[i]), m[1])
			text = strings.TrimSpace(text)
			if t := strings.TrimRight(text, "#"); t != text && (t == "" || strings.HasSuffix(t, " ")) {
				text = strings.TrimSpace(t)
			}
			add(text)
			continue
		}
		// A setext heading: a paragraph line followed by === or ---. A blank
		// line, a table row or a list item before the underline is not one.
		if i > 0 && setextUnderline.MatchString(line) && lines[i] == raw[i] {
			prev := strings.TrimSpace(lines[i-1])
			if prev != "" && lines[i-1] == raw[i-1] && !strings.HasPrefix(prev, "|") &&
				!strings.HasPrefix(prev, "- ") && !strings.HasPrefix(prev, "* ") && !atxHeading.MatchString(lines[i-1]) &&
				(i < 2 || strings.TrimSpace(lines[i-2]) == "" || atxHeading.MatchString(lines[i-2])) {
				add(prev)
			}
		}
	}
	return anchors
}

var (
	mdLinkText = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	htmlTag    = regexp.MustCompile(`<[^>]*>`)
)

// Slug returns the anchor GitHub gives a heading: its rendered text in lower
// case, with every character that is not a letter, a digit, a space, "-" or
// "_" removed, and spaces turned into "-". "Claims (skiplocked) and `Worker`"
// becomes "claims-skiplocked-and-worker".
func Slug(heading string) string {
	text := mdLinkText.ReplaceAllString(heading, "$1")
	text = htmlTag.ReplaceAllString(text, "")
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

// CheckLinks checks the relative links of the Markdown documents docs
// (slash-separated paths relative to root). A link must name a file or
// directory that exists inside root; an anchor ("#keys", "guide.md#keys")
// must be a heading or an explicit anchor of the Markdown document it points
// into. Absolute URLs (https:, mailto:) are not checked; absolute paths are
// refused, because they do not resolve in a clone. It returns one message per
// broken link, as "docs/a.md:12: link guide.md#nope: ...".
func CheckLinks(root string, docs []string) ([]string, error) {
	anchorCache := map[string]map[string]bool{}
	anchorsOf := func(doc string) (map[string]bool, error) {
		if a, ok := anchorCache[doc]; ok {
			return a, nil
		}
		src, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(doc)))
		if err != nil {
			return nil, err
		}
		a := Anchors(src)
		anchorCache[doc] = a
		return a, nil
	}
	var problems []string
	for _, doc := range docs {
		src, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(doc)))
		if err != nil {
			return nil, err
		}
		for _, l := range Links(doc, src) {
			msg, err := checkLink(root, l, anchorsOf)
			if err != nil {
				return nil, err
			}
			if msg != "" {
				problems = append(problems, fmt.Sprintf("%s: link %s: %s", l, l.Target, msg))
			}
		}
	}
	return problems, nil
}

// checkLink returns what is wrong with l, "" if nothing.
func checkLink(root string, l Link, anchorsOf func(doc string) (map[string]bool, error)) (string, error) {
	t := l.Target
	switch {
	case t == "":
		return "empty destination", nil
	case strings.HasPrefix(t, "//") || scheme.MatchString(t):
		return "", nil // an absolute URL: not checked here
	case strings.HasPrefix(t, "/"):
		return "an absolute path does not resolve in a clone; use a path relative to the document", nil
	}
	p, frag, _ := strings.Cut(t, "#")
	p, _, _ = strings.Cut(p, "?")
	p, err := url.PathUnescape(p)
	if err != nil {
		return "bad escape in the path", nil
	}
	target := l.Doc
	if p != "" {
		target = path.Clean(path.Join(path.Dir(l.Doc), p))
		if target == ".." || strings.HasPrefix(target, "../") {
			return "points outside the repository", nil
		}
		fi, err := os.Stat(filepath.Join(root, filepath.FromSlash(target)))
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Sprintf("%s does not exist", target), nil
		}
		if err != nil {
			return "", err
		}
		if fi.IsDir() {
			if frag != "" {
				return "an anchor on a directory", nil
			}
			return "", nil
		}
	}
	if frag == "" || !strings.EqualFold(path.Ext(target), ".md") {
		return "", nil
	}
	if frag, err = url.PathUnescape(frag); err != nil {
		return "bad escape in the anchor", nil
	}
	anchors, err := anchorsOf(target)
	if err != nil {
		return "", err
	}
	if !anchors[frag] {
		return fmt.Sprintf("%s has no heading or anchor #%s%s", target, frag, closest(frag, anchors)), nil
	}
	return "", nil
}

// closest suggests the anchor of anchors that shares the longest prefix with
// frag, as "; did you mean #x?".
func closest(frag string, anchors map[string]bool) string {
	best, bestN := "", 0
	for a := range anchors {
		n := 0
		for n < len(a) && n < len(frag) && a[n] == frag[n] {
			n++
		}
		if n > bestN || (n == bestN && n > 0 && a < best) {
			best, bestN = a, n
		}
	}
	if bestN < 3 {
		return ""
	}
	return fmt.Sprintf(" (did you mean #%s?)", best)
}

// MarkdownFiles returns every *.md file under root, as sorted slash-separated
// paths relative to root, skipping hidden directories, testdata and
// directories named node_modules or vendor.
func MarkdownFiles(root string) ([]string, error) {
	var docs []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if p != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules" || name == "vendor") {
				return fs.SkipDir
			}
			return nil
		}
		if strings.EqualFold(filepath.Ext(name), ".md") {
			rel, err := filepath.Rel(root, p)
			if err != nil {
				return err
			}
			docs = append(docs, filepath.ToSlash(rel))
		}
		return nil
	})
	slices.Sort(docs)
	return docs, err
}
