package otelobserve_test

import (
	"context"
	"fmt"
	"log"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/pgfence/pgfence/observe/otelobserve"
)

// Record pgfence's metrics through an OpenTelemetry MeterProvider. A real
// program gives pglock.Config, fencedwrite.Spec, skiplocked.Config and
// outbox.Config the Metrics value and attaches a periodic reader with an
// exporter (OTLP, Prometheus) to the provider; here a manual reader shows what
// pgfence's fenced-write refusals look like once recorded.
func ExampleNew() {
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = provider.Shutdown(ctx) }()

	m, err := otelobserve.New(provider)
	if err != nil {
		log.Fatal(err)
	}
	// What fencedwrite records when a write with a stale token is refused.
	m.Add(ctx, "pgfence_fenced_write_refused_total", 1, "public.invoices", "stale")

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		log.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			for _, p := range mt.Data.(metricdata.Sum[float64]).DataPoints {
				table, _ := p.Attributes.Value("table")
				reason, _ := p.Attributes.Value("reason")
				fmt.Printf("%s %s{table=%s,reason=%s} %v\n", sm.Scope.Name, mt.Name, table.AsString(), reason.AsString(), p.Value)
			}
		}
	}
	// Output:
	// github.com/pgfence/pgfence pgfence_fenced_write_refused_total{table=public.invoices,reason=stale} 1
}
