package cli

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/cmd/pgfence/internal/exporter"
)

// DefaultExporterListen is the default address of `pgfence exporter`. Port
// 19187 lies outside 9100-9999, the range of the Prometheus wiki's default
// port allocations, which is fully allocated (9187 there is
// postgres_exporter, which often runs on the same host); it is not a
// registered service port either. Override it with --listen.
const DefaultExporterListen = "127.0.0.1:19187"

func (a *app) exporterCommand() *cobra.Command {
	var listen, path, webConfigFile string
	var timeout, cacheTTL time.Duration
	var topQueues, maxWaiting int
	cmd := &cobra.Command{
		Use:   "exporter [--listen " + DefaultExporterListen + "]",
		Short: "Serve database-side pgfence state (locks, jobs) as Prometheus metrics",
		Long: `Serve a Prometheus endpoint with pgfence's database-side state: lock counts
by state, the oldest expired lease, the longest-held lease, the highest token,
unfinished jobs per queue, the oldest expired claim and the oldest ready job
per queue, and a counter of jobs that went dead. Runs until interrupted.

The database work per scrape is bounded: concurrent scrapes share one
collection (at most --max-waiting wait for it, more get 503), its result is
served for --cache-ttl, it is cut off after --scrape-timeout (also the
statement_timeout of its queries), only unfinished jobs are read (through
partial indexes, never the finished ones) and only the --top-queues queues
with the most unfinished jobs are named; queue="__other__" sums up the rest.

--web-config-file takes the web configuration file of Prometheus exporters
(tls_server_config: cert_file, key_file, client_ca_file, client_auth_type,
min_version; basic_auth_users: user -> bcrypt hash); other keys are refused.`,
		Example: `  pgfence exporter
  curl -s localhost:19187/metrics | grep ^pgfence_
  pgfence exporter --listen :19187 --web-config-file /etc/pgfence/web.yml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			switch {
			case timeout <= 0 || timeout > exporter.MaxTimeout:
				return usageErr("--scrape-timeout %v: must be above 0 and at most %v", timeout, exporter.MaxTimeout)
			case cacheTTL < 0 || cacheTTL > exporter.MaxCacheTTL:
				return usageErr("--cache-ttl %v: must be between 0 (no cache) and %v", cacheTTL, exporter.MaxCacheTTL)
			case topQueues < 1 || topQueues > exporter.MaxTopQueues:
				return usageErr("--top-queues %d: must be between 1 and %d", topQueues, exporter.MaxTopQueues)
			case maxWaiting < 1 || maxWaiting > exporter.MaxWaitingLimit:
				return usageErr("--max-waiting %d: must be between 1 and %d", maxWaiting, exporter.MaxWaitingLimit)
			case path == "" || path[0] != '/':
				return usageErr("--path %q: must start with /", path)
			}
			var web *exporter.WebConfig
			if webConfigFile != "" {
				var err error
				if web, err = exporter.LoadWebConfig(webConfigFile); err != nil {
					return withCode(ExitUsage, err)
				}
			}
			if _, _, err := net.SplitHostPort(listen); err != nil {
				return usageErr("--listen %q: want host:port (%v)", listen, err)
			}
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			ttl := cacheTTL
			if ttl == 0 {
				ttl = -1 // exporter.Options: negative turns the cache off
			}
			exp, err := exporter.New(pool, exporter.Options{
				Timeout:    timeout,
				CacheTTL:   ttl,
				TopQueues:  topQueues,
				MaxWaiting: maxWaiting,
				Logger:     slog.New(slog.NewTextHandler(a.env.Stderr, nil)),
			})
			if err != nil {
				return withCode(ExitUsage, err)
			}
			defer exp.Close()
			mux := http.NewServeMux()
			mux.Handle(path, web.Wrap(exp))
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return withCode(ExitUsage, fmt.Errorf("listen %s: %w", listen, err))
			}
			srv := &http.Server{
				Handler:           mux,
				ReadHeaderTimeout: 10 * time.Second,
				ReadTimeout:       10 * time.Second,
				// A scrape waits at most for one collection, then writes a
				// small body; slow readers do not hold a connection longer.
				WriteTimeout:   timeout + 10*time.Second,
				IdleTimeout:    2 * time.Minute,
				MaxHeaderBytes: 16 << 10,
				TLSConfig:      web.TLS(),
				ErrorLog:       log.New(a.env.Stderr, "pgfence exporter: ", 0),
			}
			scheme := "http"
			if srv.TLSConfig != nil {
				scheme = "https"
			}
			if web.HasBasicAuth() && srv.TLSConfig == nil {
				fmt.Fprintln(a.env.Stderr, "pgfence exporter: warning: basic auth without TLS sends passwords in clear text")
			}
			fmt.Fprintf(a.env.Stdout, "serving metrics on %s://%s%s\n", scheme, ln.Addr(), path)
			errc := make(chan error, 1)
			go func() {
				if srv.TLSConfig != nil {
					errc <- srv.ServeTLS(ln, "", "")
				} else {
					errc <- srv.Serve(ln)
				}
			}()
			select {
			case err := <-errc:
				return err
			case <-ctx.Done():
				sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				defer cancel()
				exp.Close() // cuts a running collection short, so Shutdown does not wait for it
				if err := srv.Shutdown(sctx); err != nil {
					return err
				}
				if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
					return err
				}
				return nil
			}
		},
	}
	cmd.Flags().StringVar(&listen, "listen", DefaultExporterListen, "address to listen on (host:port)")
	cmd.Flags().StringVar(&path, "path", "/metrics", "HTTP path of the metrics")
	cmd.Flags().DurationVar(&timeout, "scrape-timeout", exporter.DefaultTimeout, "time limit of one collection (context deadline and statement_timeout of its queries)")
	cmd.Flags().DurationVar(&cacheTTL, "cache-ttl", exporter.DefaultCacheTTL, "how long one collection's result serves scrapes (0: no cache, overlapping scrapes still share one collection)")
	cmd.Flags().IntVar(&topQueues, "top-queues", exporter.DefaultTopQueues, `queues reported by name (those with the most unfinished jobs); the rest are summed up as queue="__other__"`)
	cmd.Flags().IntVar(&maxWaiting, "max-waiting", exporter.DefaultMaxWaiting, "scrapes that may wait for a running collection; more get 503")
	cmd.Flags().StringVar(&webConfigFile, "web-config-file", "", "web configuration file (YAML) for TLS and basic auth, as for Prometheus exporters")
	return cmd
}
