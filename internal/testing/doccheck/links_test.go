package doccheck_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/doccheck"
)

// TestDocLinks checks every relative link of the repository's Markdown
// documents (README.md, docs/**, bench/README.md, ...): the file exists, and
// an anchor names a heading of the document it points into.
func TestDocLinks(t *testing.T) {
	t.Parallel()
	root, _, err := doccheck.ModuleRoot(".")
	if err != nil {
		t.Fatal(err)
	}
	docs, err := doccheck.MarkdownFiles(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, must := range []string{"README.md", "docs/README.md"} {
		if !slices.Contains(docs, must) {
			t.Fatalf("%s not found among %v", must, docs)
		}
	}
	problems, err := doccheck.CheckLinks(root, docs)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, d := range docs {
		src, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(d)))
		if err != nil {
			t.Fatal(err)
		}
		n += len(doccheck.Links(d, src))
	}
	if n == 0 {
		t.Fatal("no links found: the link extractor is broken")
	}
	t.Logf("%d links in %d documents", n, len(docs))
	for _, p := range problems {
		t.Error(p)
	}
}

// TestCheckLinksFindsBroken runs the checker on a small tree with one link of
// every kind, good and broken, and checks that exactly the broken ones are
// reported, at their lines.
func TestCheckLinksFindsBroken(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	write := func(name, text string) {
		t.Helper()
		p := filepath.Join(root, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("docs/guide.md", "# Guide\n\n## Keys and `Name`\n\n## Setup\n\n## Setup\n\n<a id=\"custom\"></a>\n\n"+
		"```sh\n# not a heading\n```\n")
	write("pkg/x.go", "package pkg\n")
	write("README.md", ""+
		"# Top\n"+ // 1
		"[ok](docs/guide.md) [ok](docs/guide.md#keys-and-name) ![img](pkg/x.go)\n"+ // 2
		"[ok](docs/guide.md#setup-1) [ok](docs/guide.md#custom) [ok](#top) [ok](pkg/)\n"+ // 3
		"[ok](https://example.com/x.md) [ok](<docs/guide.md>) [ok](docs/guide.md \"title\")\n"+ // 4
		"[bad](docs/missing.md)\n"+ // 5
		"[bad](docs/guide.md#setup-2)\n"+ // 6
		"[bad](#nowhere) [bad](/etc/passwd)\n"+ // 7
		"`[in code](nope.md)` <!-- [in a comment](nope.md) -->\n"+ // 8
		"```md\n[in a block](nope.md)\n```\n"+ // 9-11
		"[bad](../outside.md)\n"+ // 12
		"[ref]: docs/gone.md\n"+ // 13
		"[bad](docs/guide.md#not-a-heading)\n") // 14
	problems, err := doccheck.CheckLinks(root, []string{"README.md", "docs/guide.md"})
	if err != nil {
		t.Fatal(err)
	}
	wants := []string{
		"README.md:5: link docs/missing.md: docs/missing.md does not exist",
		"README.md:6: link docs/guide.md#setup-2: docs/guide.md has no heading or anchor #setup-2",
		"README.md:7: link #nowhere: README.md has no heading or anchor #nowhere",
		"README.md:7: link /etc/passwd: an absolute path",
		"README.md:12: link ../outside.md: points outside the repository",
		"README.md:13: link docs/gone.md: docs/gone.md does not exist",
		"README.md:14: link docs/guide.md#not-a-heading: docs/guide.md has no heading",
	}
	if len(problems) != len(wants) {
		t.Errorf("%d problems, want %d:\n%s", len(problems), len(wants), strings.Join(problems, "\n"))
	}
	for _, w := range wants {
		if !slices.ContainsFunc(problems, func(p string) bool { return strings.HasPrefix(p, w) }) {
			t.Errorf("no problem starting with %q in:\n%s", w, strings.Join(problems, "\n"))
		}
	}
}

func TestSlug(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"Lease locks and fencing tokens (pglock)": "lease-locks-and-fencing-tokens-pglock",
		"One clock: the database's":               "one-clock-the-databases",
		"Claims (skiplocked) and `Worker`":        "claims-skiplocked-and-worker",
		"Generated helpers (generator → sqlc)":    "generated-helpers-generator--sqlc",
		"[Link](x.md) text_with_underscore":       "link-text_with_underscore",
		"Exit codes, 75–76":                       "exit-codes-7576",
	} {
		if got := doccheck.Slug(in); got != want {
			t.Errorf("Slug(%q) = %q, want %q", in, got, want)
		}
	}
}
