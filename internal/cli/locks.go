package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// lockView is one lock as printed by `pgfence locks` (JSON field names are
// part of the CLI's interface).
type lockView struct {
	Name        string          `json:"name"`
	State       string          `json:"state"`
	Holder      *string         `json:"holder"`
	Token       int64           `json:"token"`
	AcquiredAt  *time.Time      `json:"acquired_at"`
	RenewedAt   *time.Time      `json:"renewed_at"`
	ExpiresAt   *time.Time      `json:"expires_at"`
	ExpiresInMS *int64          `json:"expires_in_ms"`
	Metadata    json.RawMessage `json:"metadata,omitempty"`
	DBNow       time.Time       `json:"db_now"`
}

func viewOf(name string, token int64, holder *string, acq, ren, exp *time.Time, meta []byte, state string, inMS int64, now time.Time) lockView {
	v := lockView{Name: name, State: state, Holder: holder, Token: token, AcquiredAt: acq, RenewedAt: ren, ExpiresAt: exp, DBNow: now}
	if state != "free" {
		ms := inMS
		v.ExpiresInMS = &ms
	}
	if len(meta) > 0 {
		v.Metadata = json.RawMessage(meta)
	}
	return v
}

func (a *app) locksCommand() *cobra.Command {
	var (
		held, expired, free, jsonOut bool
		pattern                      string
		limit                        int32
	)
	cmd := &cobra.Command{
		Use:   "locks",
		Short: "List lease locks: state on the database clock (held / expired / free), holder, token, expiry",
		Long: `List the rows of pgfence.locks. State and "expires in" are computed on the
database's clock. With no state flag every state is listed; state flags combine.`,
		Example: `  pgfence locks
  pgfence locks --held --name 'invoice:%'
  pgfence locks --expired --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit <= 0 {
				return usageErr("--limit must be > 0")
			}
			states := []string{}
			if held {
				states = append(states, "held")
			}
			if expired {
				states = append(states, "expired")
			}
			if free {
				states = append(states, "free")
			}
			if len(states) == 0 {
				states = []string{"held", "expired", "free"}
			}
			ctx := cmd.Context()
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			rows, err := dbsqlc.New().ListLocks(ctx, pool, dbsqlc.ListLocksParams{NamePattern: pattern, States: states, MaxRows: limit})
			if err != nil {
				return err
			}
			views := make([]lockView, 0, len(rows))
			for _, r := range rows {
				views = append(views, viewOf(r.Name, r.Token, r.Holder, r.AcquiredAt, r.RenewedAt, r.ExpiresAt, r.Metadata, r.State, r.ExpiresInMs, r.DbNow))
			}
			if jsonOut {
				return writeJSON(a.env.Stdout, views)
			}
			return printLocks(a.env.Stdout, views)
		},
	}
	f := cmd.Flags()
	f.BoolVar(&held, "held", false, "only locks held now")
	f.BoolVar(&expired, "expired", false, "only locks whose holder's lease ran out without a release")
	f.BoolVar(&free, "free", false, "only released (or never granted) locks")
	f.StringVar(&pattern, "name", "%", "SQL LIKE pattern on the lock name, e.g. 'invoice:%'")
	f.Int32Var(&limit, "limit", 1000, "maximum rows")
	f.BoolVar(&jsonOut, "json", false, "print JSON")

	var showJSON bool
	show := &cobra.Command{
		Use:   "show NAME",
		Short: "Show one lock in detail (exit 3 if there is no such lock)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			r, err := dbsqlc.New().GetLock(ctx, pool, args[0])
			if errors.Is(err, pgx.ErrNoRows) {
				return withCode(ExitNotFound, fmt.Errorf("no lock named %q", args[0]))
			}
			if err != nil {
				return err
			}
			v := viewOf(r.Name, r.Token, r.Holder, r.AcquiredAt, r.RenewedAt, r.ExpiresAt, r.Metadata, r.State, r.ExpiresInMs, r.DbNow)
			if showJSON {
				return writeJSON(a.env.Stdout, v)
			}
			tw := tabwriter.NewWriter(a.env.Stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintf(tw, "name:\t%s\n", termSafe(v.Name))
			fmt.Fprintf(tw, "state:\t%s\n", termSafe(v.State))
			fmt.Fprintf(tw, "holder:\t%s\n", termSafeOr(v.Holder, "-"))
			fmt.Fprintf(tw, "token:\t%d\n", v.Token)
			fmt.Fprintf(tw, "acquired at:\t%s\n", timeOr(v.AcquiredAt))
			fmt.Fprintf(tw, "renewed at:\t%s\n", timeOr(v.RenewedAt))
			fmt.Fprintf(tw, "expires at:\t%s\n", timeOr(v.ExpiresAt))
			fmt.Fprintf(tw, "expires in:\t%s\n", expiresIn(v))
			if len(v.Metadata) > 0 {
				fmt.Fprintf(tw, "metadata:\t%s\n", termSafe(string(v.Metadata)))
			}
			fmt.Fprintf(tw, "database now:\t%s\n", v.DBNow.UTC().Format(time.RFC3339Nano))
			return tw.Flush()
		},
	}
	show.Flags().BoolVar(&showJSON, "json", false, "print JSON")
	cmd.AddCommand(show)
	return cmd
}

func printLocks(w io.Writer, views []lockView) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSTATE\tHOLDER\tTOKEN\tACQUIRED\tEXPIRES IN")
	for _, v := range views {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", termSafe(v.Name), termSafe(v.State), termSafeOr(v.Holder, "-"),
			v.Token, timeOr(v.AcquiredAt), expiresIn(v))
	}
	return tw.Flush()
}

func expiresIn(v lockView) string {
	if v.ExpiresInMS == nil {
		return "-"
	}
	d := time.Duration(*v.ExpiresInMS) * time.Millisecond
	if d < 0 {
		return fmt.Sprintf("expired %s ago", (-d).Round(100*time.Millisecond))
	}
	return d.Round(100 * time.Millisecond).String()
}

// termSafe returns s for printing in a table or text output: unchanged when
// it is valid UTF-8 made of printable characters and spaces, otherwise
// quoted as a Go string literal (strconv.Quote: "\x1b[2J", "a\nb",
// "\u202e", "\xff"). Lock names, holders and metadata come from the
// database, where anyone who can take a lock can write them; printed raw, an
// escape sequence could clear the screen or retitle the terminal, a newline
// or tab could forge rows and columns, a bidirectional override could
// reorder what is shown. A value that begins with a double quote is quoted
// too, so a printed value is never ambiguous. --json output is escaped by
// the JSON encoder instead, and carries the exact value.
func termSafe(s string) string {
	if strings.HasPrefix(s, `"`) || !utf8.ValidString(s) {
		return strconv.Quote(s)
	}
	for _, r := range s {
		if r != ' ' && !strconv.IsPrint(r) {
			return strconv.Quote(s)
		}
	}
	return s
}

// termSafeOr is [termSafe] of *s, or def when s is nil.
func termSafeOr(s *string, def string) string {
	if s == nil {
		return def
	}
	return termSafe(*s)
}

func timeOr(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// writeJSON prints v as indented JSON. Characters a terminal may act on that
// encoding/json leaves raw (DEL, C1 controls, format characters such as
// bidirectional overrides) are written as \u escapes: they can only occur
// inside JSON strings, where the escape stands for the same character, so the
// values decode exactly as stored.
func writeJSON(w io.Writer, v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	_, err := w.Write(escapeJSONControls(buf.Bytes()))
	return err
}

// escapeJSONControls rewrites the DEL, C1 control and format characters of
// JSON text produced by encoding/json (valid UTF-8, C0 controls already
// escaped) as \u escapes.
func escapeJSONControls(b []byte) []byte {
	var out []byte
	for i := 0; i < len(b); {
		r, size := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError && r != '\n' && (unicode.IsControl(r) || unicode.Is(unicode.Cf, r)) {
			if out == nil {
				out = append(make([]byte, 0, len(b)+16), b[:i]...)
			}
			if r > 0xFFFF {
				r1, r2 := utf16.EncodeRune(r)
				out = fmt.Appendf(out, `\u%04x\u%04x`, r1, r2)
			} else {
				out = fmt.Appendf(out, `\u%04x`, r)
			}
		} else if out != nil {
			out = append(out, b[i:i+size]...)
		}
		i += size
	}
	if out == nil {
		return b
	}
	return out
}
