// Package cli implements the pgfence command. cmd/pgfence is a thin main over
// [Main]; every command writes to the io.Writers it is given, so tests drive it
// in-process.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/pgerr"
)

// Exit codes. Scripts can rely on them; they are listed in docs/cli.md.
const (
	ExitOK          = 0  // success
	ExitError       = 1  // any other failure (connection, SQL, I/O)
	ExitUsage       = 2  // bad flags or arguments
	ExitNotFound    = 3  // the named lock or table does not exist
	ExitNotMigrated = 4  // the database has no pgfence schema: run `pgfence migrate up`
	ExitLockBusy    = 75 // --no-wait and the lock is held by someone else
	ExitLeaseLost   = 76 // the lease was lost (run: while the command ran; renew, release: before the call)
)

// exitError carries an exit code with an error.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func withCode(code int, err error) error {
	if err == nil {
		return nil
	}
	return &exitError{code: code, err: err}
}

func usageErr(format string, args ...any) error {
	return withCode(ExitUsage, fmt.Errorf(format, args...))
}

// Env is what a command run sees of the outside world.
type Env struct {
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	// Getenv reads environment variables. Defaults to os.Getenv.
	Getenv func(string) string
}

type app struct {
	env             Env
	databaseURL     string
	databaseURLFile string
}

// Main runs the pgfence command with args (without the program name) and
// returns the process exit code.
func Main(ctx context.Context, args []string, env Env) int {
	if env.Getenv == nil {
		env.Getenv = os.Getenv
	}
	if env.Stdin == nil {
		env.Stdin = strings.NewReader("")
	}
	a := &app{env: env}
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetIn(env.Stdin)
	root.SetOut(env.Stdout)
	root.SetErr(env.Stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return ExitOK
	}
	// The exit code is the one the error was tagged with where it arose:
	// cobra's own errors (flags, arguments, unknown commands) are tagged
	// ExitUsage by tagUsageErrors and refuseUnknownSubcommands, never
	// recognised by their text, which may come from the database or from a
	// name the user gave.
	var ee *exitError
	code := ExitError
	if errors.As(err, &ee) {
		code = ee.code
	}
	fmt.Fprintf(env.Stderr, "pgfence: %s\n", termLine(err.Error())) // errors may carry database strings
	return code
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "pgfence",
		Short: "Lease locks with fencing tokens on PostgreSQL: inspect, run commands under a lock, demo",
		Long: `pgfence inspects and uses pgfence's lock table and fenced tables.

Connection: --database-url-file (or --database-url), else DATABASE_URL, else
the standard PG* variables (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, ...).
--database-url is discouraged: a command line is visible to every user of the
machine (ps, /proc/PID/cmdline), so a password in it leaks; use the
environment or --database-url-file.

Exit codes: 0 ok, 1 error, 2 usage, 3 not found, 4 not migrated,
5 forged fence found (fences), 75 lock busy (--no-wait), 76 lease lost (run, renew, release);
run: 126 command not executable, 127 command not found, else the command's status.`,
		Version:       readVersion().line(),
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			return a.loadDatabaseURLFile()
		},
	}
	root.SetVersionTemplate("{{.Version}}\n")
	root.PersistentFlags().StringVar(&a.databaseURL, "database-url", "", "PostgreSQL connection string; discouraged, the command line is visible to other users: prefer DATABASE_URL or --database-url-file (default: DATABASE_URL, then PG* variables)")
	root.PersistentFlags().StringVar(&a.databaseURLFile, "database-url-file", "", "file holding the PostgreSQL connection string (surrounding white space ignored)")
	root.AddCommand(
		a.migrateCommand(),
		a.locksCommand(),
		a.fencesCommand(),
		a.exporterCommand(),
		a.genCommand(),
		a.advisoryCommand(),
		a.jobsCommand(),
		a.outboxCommand(),
		a.versionCommand(),
	)
	a.addLeaseCommands(root)
	a.addDemoCommands(root)
	root.InitDefaultCompletionCmd()
	root.SetHelpCommand(helpCommand())
	refuseUnknownSubcommands(root)
	tagUsageErrors(root)
	return root
}

// refuseUnknownSubcommands makes every command that only groups others
// (pgfence itself, migrate, gen, advisory, completion) refuse an argument
// that names none of them, with exit 2. cobra shows such a group's help and
// exits 0, so a typo in a deploy script ("pgfence migrate upp") would pass
// for success; for pgfence itself cobra's own error would carry no exit
// code. With no argument the group still shows its help.
func refuseUnknownSubcommands(c *cobra.Command) {
	for _, sub := range c.Commands() {
		refuseUnknownSubcommands(sub)
	}
	if !c.HasSubCommands() || c.Runnable() {
		return
	}
	c.Args = cobra.ArbitraryArgs
	c.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return cmd.Help()
		}
		msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
		if cmd.SuggestionsMinimumDistance <= 0 {
			cmd.SuggestionsMinimumDistance = 2 // cobra's default
		}
		if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
			msg += fmt.Sprintf(" (did you mean %s?)", strings.Join(s, ", "))
		}
		return usageErr("%s", msg)
	}
}

// helpCommand is `pgfence help [command]`. cobra's own prints "Unknown help
// topic" for a command that does not exist and exits 0; this one exits 2,
// as the command itself would.
func helpCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "help [command]",
		Short: "Help about any command",
		Long:  "Help provides help for any command in the application.\nSimply type pgfence help [path to command] for full details.",
		Args:  cobra.ArbitraryArgs,
		RunE: func(c *cobra.Command, args []string) error {
			cmd, rest, err := c.Root().Find(args)
			if err != nil || cmd == nil || (len(rest) > 0 && cmd.HasSubCommands()) {
				return usageErr("unknown help topic %q", strings.Join(args, " "))
			}
			cmd.InitDefaultHelpFlag()
			cmd.InitDefaultVersionFlag()
			return cmd.Help()
		},
	}
}

// tagUsageErrors gives cobra's own errors about c and its subcommands the
// usage exit code where they arise: flag parsing (unknown flag, bad value,
// missing value) through the flag error function, which subcommands inherit,
// and argument counts through each command's Args validator. Errors a
// command's RunE returns keep the code they were given (1 when none).
func tagUsageErrors(c *cobra.Command) {
	if !c.HasParent() {
		c.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return withCode(ExitUsage, err) })
	}
	if v := c.Args; v != nil {
		c.Args = func(cmd *cobra.Command, args []string) error { return withCode(ExitUsage, v(cmd, args)) }
	}
	for _, sub := range c.Commands() {
		tagUsageErrors(sub)
	}
}

// loadDatabaseURLFile reads --database-url-file into databaseURL, before any
// command runs (root's PersistentPreRunE).
func (a *app) loadDatabaseURLFile() error {
	if a.databaseURLFile == "" {
		return nil
	}
	if a.databaseURL != "" {
		return usageErr("--database-url and --database-url-file cannot be used together")
	}
	b, err := os.ReadFile(a.databaseURLFile)
	if err != nil {
		return withCode(ExitUsage, fmt.Errorf("--database-url-file: %w", err))
	}
	a.databaseURL = strings.TrimSpace(string(b))
	if a.databaseURL == "" {
		return usageErr("--database-url-file: %s is empty", a.databaseURLFile)
	}
	return nil
}

// dsn returns the connection string from --database-url (or the file of
// --database-url-file) or DATABASE_URL; "" means the PG* variables and
// libpq defaults.
func (a *app) dsn() string {
	if a.databaseURL != "" {
		return a.databaseURL
	}
	return a.env.Getenv("DATABASE_URL")
}

// connect opens a pool and checks the server answers. Errors are one line.
func (a *app) connect(ctx context.Context) (*pgxpool.Pool, error) {
	return connectDSN(ctx, a.dsn())
}

// connectDSN is connect for a given connection string: the one path that
// parses a connection string, so that an error about it never prints its
// password and exits 2.
func connectDSN(ctx context.Context, dsn string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, withCode(ExitUsage, fmt.Errorf("invalid connection string: %s", redactSecrets(dsn, parseErrorText(err))))
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 10 * time.Second
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = "pgfence-cli"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("cannot connect to database: %s", oneLine(err))
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("cannot connect to database %s: %s", describe(cfg.ConnConfig.Config), oneLine(err))
	}
	return pool, nil
}

// connectMigrated is connect plus a check that the pgfence schema exists.
func (a *app) connectMigrated(ctx context.Context) (*pgxpool.Pool, error) {
	pool, err := a.connect(ctx)
	if err != nil {
		return nil, err
	}
	var ok bool
	if err := pool.QueryRow(ctx, "SELECT pg_catalog.to_regclass('pgfence.locks') IS NOT NULL").Scan(&ok); err != nil {
		pool.Close()
		return nil, err
	}
	if !ok {
		pool.Close()
		return nil, withCode(ExitNotMigrated, errors.New("database has no pgfence schema; run: pgfence migrate up"))
	}
	return pool, nil
}

func describe(c pgconn.Config) string {
	return fmt.Sprintf("%s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
}

func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

// parseErrorText is the text of an error of pgx's connection string parser
// without the connection string it quotes (pgerr.ParseConfigText), on one
// line. What is left (what was wrong: "invalid port") goes through
// [redactSecrets] too.
func parseErrorText(err error) string {
	if rest, ok := pgerr.ParseConfigText(err); ok {
		return oneLine(errors.New(rest))
	}
	return oneLine(err)
}

// kvPassword finds the password of a key/value connection string, with or
// without spaces around '=' and quoted or not: a second, coarser look for
// what kvSecrets may miss in a string libpq would not parse.
var kvPassword = regexp.MustCompile(`(?i)\bpassword\s*=\s*('(?:[^'\\]|\\.)*'|[^\s]+)`)

// kvSecrets returns the values of the password and sslpassword keywords of a
// key/value connection string read as libpq reads it: keyword, '=' (white
// space around it allowed), and a value in single quotes or up to the next
// white space, a backslash escaping the next character in both. Each value
// is returned as written (quotes and backslashes included, and without its
// quotes) and as libpq reads it (escapes resolved). A value whose closing
// quote is missing runs to the end of the string. Reading stops where the
// string stops looking like key/value pairs.
func kvSecrets(dsn string) []string {
	space := func(c byte) bool { return strings.IndexByte(" \t\n\r\f\v", c) >= 0 }
	var secrets []string
	for i := 0; i < len(dsn); {
		for i < len(dsn) && space(dsn[i]) {
			i++
		}
		k := i
		for i < len(dsn) && dsn[i] != '=' && !space(dsn[i]) {
			i++
		}
		key := dsn[k:i]
		for i < len(dsn) && space(dsn[i]) {
			i++
		}
		if key == "" || i >= len(dsn) || dsn[i] != '=' {
			return secrets
		}
		i++
		for i < len(dsn) && space(dsn[i]) {
			i++
		}
		v := i
		var val strings.Builder
		if i < len(dsn) && dsn[i] == '\'' {
			for i++; i < len(dsn); i++ {
				if dsn[i] == '\\' && i+1 < len(dsn) {
					i++
				} else if dsn[i] == '\'' {
					i++
					break
				}
				val.WriteByte(dsn[i])
			}
		} else {
			for ; i < len(dsn) && !space(dsn[i]); i++ {
				if dsn[i] == '\\' && i+1 < len(dsn) {
					i++
				}
				val.WriteByte(dsn[i])
			}
		}
		if strings.EqualFold(key, "password") || strings.EqualFold(key, "sslpassword") {
			raw := dsn[v:i]
			secrets = append(secrets, raw, strings.TrimSuffix(strings.TrimPrefix(raw, "'"), "'"), val.String())
		}
	}
	return secrets
}

// redactSecrets removes from msg every password found in the connection
// string dsn (key/value or URL form), and the connection string itself: an
// error about a malformed connection string must not print its password,
// whatever the parser's own redaction missed.
func redactSecrets(dsn, msg string) string {
	secrets := kvSecrets(dsn)
	for _, m := range kvPassword.FindAllStringSubmatch(dsn, -1) {
		v := m[1]
		secrets = append(secrets, v, strings.Trim(v, "'"))
	}
	if _, rest, ok := strings.Cut(dsn, "://"); ok {
		userinfo := rest
		if i := strings.IndexAny(userinfo, "/?"); i >= 0 {
			userinfo = userinfo[:i]
		}
		if i := strings.LastIndex(userinfo, "@"); i >= 0 {
			if _, pw, ok := strings.Cut(userinfo[:i], ":"); ok {
				secrets = append(secrets, pw)
				if u, err := url.PathUnescape(pw); err == nil {
					secrets = append(secrets, u)
				}
			}
		}
	}
	if strings.TrimSpace(dsn) != "" {
		msg = strings.ReplaceAll(msg, dsn, "<connection string>")
	}
	// Longest first: a secret that holds another is replaced whole.
	slices.SortFunc(secrets, func(a, b string) int { return len(b) - len(a) })
	for _, sec := range secrets {
		if sec != "" {
			msg = strings.ReplaceAll(msg, sec, "xxxxx")
		}
	}
	return msg
}
