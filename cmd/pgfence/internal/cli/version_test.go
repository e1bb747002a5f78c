package cli

import (
	"encoding/json"
	"runtime/debug"
	"strings"
	"testing"
)

func TestVersionInfo(t *testing.T) {
	t.Parallel()
	const rev = "357be771345713fa7f893c81e9a1521a99055ab4"
	build := func(version string, settings ...string) *debug.BuildInfo {
		bi := &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Path: modulePath, Version: version}}
		for i := 0; i < len(settings); i += 2 {
			bi.Settings = append(bi.Settings, debug.BuildSetting{Key: settings[i], Value: settings[i+1]})
		}
		return bi
	}
	for _, tc := range []struct {
		name        string
		bi          *debug.BuildInfo
		line        string
		details     []string
		notInDetail []string
	}{
		{
			name: "release",
			bi:   build("v0.1.0"),
			line: "pgfence v0.1.0 (github.com/pgfence/pgfence/cmd/pgfence, go1.99.1, linux/amd64)",
			details: []string{"version:   v0.1.0\n", "module:    github.com/pgfence/pgfence/cmd/pgfence\n",
				"revision:  unknown (built without version control information)\n", "go:        go1.99.1\n"},
			notInDetail: []string{"committed:"},
		},
		{
			name: "clean checkout",
			bi: build("v0.1.1-0.20261201064309-357be7713457",
				"vcs", "git", "vcs.revision", rev, "vcs.time", "2026-12-01T06:43:09Z", "vcs.modified", "false"),
			line:        "pgfence v0.1.1-0.20261201064309-357be7713457 (github.com/pgfence/pgfence/cmd/pgfence, revision 357be7713457 from 2026-12-01T06:43:09Z, go1.99.1, linux/amd64)",
			details:     []string{"revision:  " + rev + "\n", "committed: 2026-12-01T06:43:09Z\n"},
			notInDetail: []string{"uncommitted", "+dirty"},
		},
		{
			name:    "dirty checkout",
			bi:      build("(devel)", "vcs.revision", rev, "vcs.modified", "true"),
			line:    "pgfence (devel) (github.com/pgfence/pgfence/cmd/pgfence, revision 357be7713457+dirty, go1.99.1, linux/amd64)",
			details: []string{"revision:  " + rev + " with uncommitted changes\n"},
		},
		{
			name:    "empty main version",
			bi:      build(""),
			line:    "pgfence (devel) (github.com/pgfence/pgfence/cmd/pgfence, go1.99.1, linux/amd64)",
			details: []string{"version:   (devel)\n"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newVersionInfo(tc.bi, "linux/amd64")
			if got := v.line(); got != tc.line {
				t.Errorf("line:\n got %q\nwant %q", got, tc.line)
			}
			d := v.details()
			if !strings.HasPrefix(d, tc.line+"\n") {
				t.Errorf("details do not start with the line:\n%s", d)
			}
			for _, want := range append(tc.details, "schema:    ", "platform:  linux/amd64\n") {
				if !strings.Contains(d, want) {
					t.Errorf("details lack %q:\n%s", want, d)
				}
			}
			for _, bad := range tc.notInDetail {
				if strings.Contains(d, bad) {
					t.Errorf("details contain %q:\n%s", bad, d)
				}
			}
		})
	}

	// No build information at all: still the module path and a version word.
	v := newVersionInfo(nil, "linux/amd64")
	if v.Module != modulePath || v.Version != "unknown" || v.GoVersion == "" {
		t.Errorf("without build info: %+v", v)
	}
	if v.Schema < 1 {
		t.Errorf("schema version %d: the embedded migrations were not counted", v.Schema)
	}
}

// TestVersionCommands runs --version and version in-process: exit 0, no
// database needed, even with a --database-url-file that does not exist.
func TestVersionCommands(t *testing.T) {
	t.Parallel()
	r := run(t, "", "--version")
	if r.code != ExitOK || r.stderr != "" {
		t.Fatalf("--version: %+v", r)
	}
	line := strings.TrimSuffix(r.stdout, "\n")
	if strings.Contains(line, "\n") || !strings.HasPrefix(line, "pgfence ") || !strings.Contains(line, modulePath) {
		t.Fatalf("--version printed %q, want one line naming pgfence and %s", r.stdout, modulePath)
	}

	r = run(t, "", "version", "--database-url-file", "/nonexistent/pgfence-dsn")
	if r.code != ExitOK || !strings.HasPrefix(r.stdout, line+"\n") || !strings.Contains(r.stdout, "module:    "+modulePath) {
		t.Fatalf("version: %+v", r)
	}

	r = run(t, "", "version", "--json")
	var v versionInfo
	if err := json.Unmarshal([]byte(r.stdout), &v); err != nil || r.code != ExitOK {
		t.Fatalf("version --json: %+v (%v)", r, err)
	}
	if v.Module != modulePath || v.Version == "" || v.GoVersion == "" || v.Schema < 1 {
		t.Fatalf("version --json: %+v", v)
	}

	if r = run(t, "", "version", "extra"); r.code != ExitUsage {
		t.Fatalf("version with an argument: %+v", r)
	}
}
