package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/exporter"
)

func (a *app) exporterCommand() *cobra.Command {
	var listen, path string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "exporter [--listen 127.0.0.1:9187]",
		Short: "Serve database-side pgfence state (locks, jobs) as Prometheus metrics",
		Long: `Serve a Prometheus endpoint that reads pgfence's tables on every scrape:
lock counts by state, the oldest expired lease, the longest-held lease, the
highest token, jobs by queue and state, the oldest expired claim and the oldest
ready job per queue. Runs until interrupted.`,
		Example: `  pgfence exporter --listen 127.0.0.1:9187
  curl -s localhost:9187/metrics | grep ^pgfence_`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			reg := prometheus.NewRegistry()
			reg.MustRegister(exporter.New(pool, timeout))
			mux := http.NewServeMux()
			mux.Handle(path, promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return withCode(ExitUsage, fmt.Errorf("listen %s: %w", listen, err))
			}
			srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
			fmt.Fprintf(a.env.Stdout, "serving metrics on http://%s%s\n", ln.Addr(), path)
			errc := make(chan error, 1)
			go func() { errc <- srv.Serve(ln) }()
			select {
			case err := <-errc:
				return err
			case <-ctx.Done():
				sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				defer cancel()
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
	cmd.Flags().StringVar(&listen, "listen", "127.0.0.1:9187", "address to listen on")
	cmd.Flags().StringVar(&path, "path", "/metrics", "HTTP path of the metrics")
	cmd.Flags().DurationVar(&timeout, "scrape-timeout", 5*time.Second, "time limit for the queries of one scrape")
	return cmd
}
