// Package promobserve adapts pgfence's [observe.Metrics] to Prometheus.
//
//	reg := prometheus.NewRegistry()
//	m, err := promobserve.New(reg)
//	locker, err := pglock.New(pool, &pglock.Config{Metrics: m})
package promobserve

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgfence/pgfence/observe"
)

// Metrics records pgfence's metrics into Prometheus collectors registered at
// construction. Names outside [observe.Catalog] are ignored.
type Metrics struct {
	counters   map[string]*prometheus.CounterVec
	histograms map[string]*prometheus.HistogramVec
}

var _ observe.Metrics = (*Metrics)(nil)

// New registers every metric of [observe.Catalog] with reg.
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{counters: map[string]*prometheus.CounterVec{}, histograms: map[string]*prometheus.HistogramVec{}}
	for _, d := range observe.Catalog {
		var c prometheus.Collector
		switch d.Kind {
		case observe.Counter:
			v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: d.Name, Help: d.Help}, d.Labels)
			m.counters[d.Name], c = v, v
		case observe.Histogram:
			v := prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name: d.Name, Help: d.Help,
				Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
			}, d.Labels)
			m.histograms[d.Name], c = v, v
		default:
			return nil, fmt.Errorf("promobserve: unknown kind of %s", d.Name)
		}
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("promobserve: register %s: %w", d.Name, err)
		}
	}
	return m, nil
}

// Add implements observe.Metrics.
func (m *Metrics) Add(name string, delta float64, labelValues ...string) {
	if v, ok := m.counters[name]; ok {
		if c, err := v.GetMetricWithLabelValues(labelValues...); err == nil {
			c.Add(delta)
		}
	}
}

// Observe implements observe.Metrics.
func (m *Metrics) Observe(name string, value float64, labelValues ...string) {
	if v, ok := m.histograms[name]; ok {
		if h, err := v.GetMetricWithLabelValues(labelValues...); err == nil {
			h.Observe(value)
		}
	}
}
