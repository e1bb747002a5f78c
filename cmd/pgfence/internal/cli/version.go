package cli

import (
	"fmt"
	"io/fs"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/migrations"
)

// modulePath is the command's module, reported when the binary carries no build
// information.
const modulePath = "github.com/pgfence/pgfence/cmd/pgfence"

// shortRevision is how many hex digits of a commit the one-line version shows
// (as many as Go's pseudo-versions).
const shortRevision = 12

// versionInfo is what `pgfence version` reports: the build information Go
// records in every binary, and the newest migration the binary applies.
type versionInfo struct {
	Module string `json:"module"`
	// Version is the module version: vX.Y.Z when installed with
	// `go install github.com/pgfence/pgfence/cmd/pgfence@vX.Y.Z`, a
	// pseudo-version or "(devel)" when built from a checkout.
	Version string `json:"version"`
	// Revision is the commit built from, when the build recorded it.
	Revision string `json:"revision,omitempty"`
	// Time is the commit time (RFC 3339), when recorded.
	Time string `json:"revision_time,omitempty"`
	// Modified: the checkout had uncommitted changes (only with a Revision).
	Modified bool `json:"modified,omitempty"`
	// Schema is the version of the newest migration the binary applies.
	Schema    int64  `json:"schema_version"`
	GoVersion string `json:"go"`
	Platform  string `json:"platform"`
}

// readVersion reads the running binary's version information.
func readVersion() versionInfo {
	bi, _ := debug.ReadBuildInfo() // nil without build information
	return newVersionInfo(bi, runtime.GOOS+"/"+runtime.GOARCH)
}

// newVersionInfo extracts the version from bi (nil: no build information).
func newVersionInfo(bi *debug.BuildInfo, platform string) versionInfo {
	v := versionInfo{
		Module:    modulePath,
		Version:   "unknown",
		Schema:    newestMigration(),
		GoVersion: runtime.Version(),
		Platform:  platform,
	}
	if bi == nil {
		return v
	}
	if bi.GoVersion != "" {
		v.GoVersion = bi.GoVersion
	}
	if bi.Main.Path != "" {
		v.Module = bi.Main.Path
	}
	v.Version = bi.Main.Version
	if v.Version == "" {
		v.Version = "(devel)"
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Revision = s.Value
		case "vcs.time":
			v.Time = s.Value
		case "vcs.modified":
			v.Modified = s.Value == "true"
		}
	}
	return v
}

// line is the one-line version that `pgfence --version` prints.
func (v versionInfo) line() string {
	parts := []string{v.Module}
	if v.Revision != "" {
		rev := v.Revision
		if len(rev) > shortRevision {
			rev = rev[:shortRevision]
		}
		if v.Modified {
			rev += "+dirty"
		}
		if v.Time != "" {
			rev += " from " + v.Time
		}
		parts = append(parts, "revision "+rev)
	}
	parts = append(parts, v.GoVersion, v.Platform)
	return fmt.Sprintf("pgfence %s (%s)", v.Version, strings.Join(parts, ", "))
}

// details is what `pgfence version` prints: the line, then one field a line.
func (v versionInfo) details() string {
	var b strings.Builder
	b.WriteString(v.line() + "\n")
	field := func(name, value string) { fmt.Fprintf(&b, "%-10s %s\n", name+":", value) }
	field("module", v.Module)
	field("version", v.Version)
	switch {
	case v.Revision == "":
		field("revision", "unknown (built without version control information)")
	case v.Modified:
		field("revision", v.Revision+" with uncommitted changes")
	default:
		field("revision", v.Revision)
	}
	if v.Time != "" {
		field("committed", v.Time)
	}
	field("schema", fmt.Sprintf("%d (newest migration this binary applies; compare: pgfence migrate version)", v.Schema))
	field("go", v.GoVersion)
	field("platform", v.Platform)
	return b.String()
}

// newestMigration returns the version number of the newest embedded
// migration (the number before the first "_" of its file name).
func newestMigration() int64 {
	var newest int64
	names, _ := fs.Glob(migrations.FS(), "*.sql")
	for _, n := range names {
		num, _, _ := strings.Cut(n, "_")
		if v, err := strconv.ParseInt(num, 10, 64); err == nil && v > newest {
			newest = v
		}
	}
	return newest
}

func (a *app) versionCommand() *cobra.Command {
	var jsonOut bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print pgfence's version, the commit it was built from, and the Go version",
		Long: `Prints the module version (vX.Y.Z when installed with
go install github.com/pgfence/pgfence/cmd/pgfence@vX.Y.Z; a pseudo-version or
"(devel)" when built from a checkout), the commit it was built from when the
build recorded it ("with uncommitted changes" for a modified checkout), the
newest schema migration the binary applies, and the Go version and platform.
--version prints the first line only. Needs no database.`,
		Args: cobra.NoArgs,
		// No database: skip root's --database-url-file check.
		PersistentPreRunE: func(*cobra.Command, []string) error { return nil },
		RunE: func(*cobra.Command, []string) error {
			v := readVersion()
			if jsonOut {
				return writeJSON(a.env.Stdout, v)
			}
			_, err := fmt.Fprint(a.env.Stdout, v.details())
			return err
		},
	}
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON")
	return cmd
}
