package main

import (
	"fmt"
	"image/color"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// chartLine is one line of the throughput chart: a series of rows with the
// same scenario and variant, one per client count.
type chartLine struct {
	label, scenario, variant string
}

var chartLines = []chartLine{
	{"L0 UPDATE, random row (limit)", "L0 UPDATE limit", "random row"},
	{"L0 UPDATE, hot row", "L0 UPDATE limit", "hot row"},
	{"B1 pgfence acquire+fenced write+release", "B1 distinct names", keyB1Full},
	{"B1 pgfence acquire+release", "B1 distinct names", keyB1Bare},
	{"B1 pgfence acquire+release, 4 processes", "B1 distinct names", keyB1Procs},
	{"B3 fenced UPDATE", "B3 fenced vs unconditional UPDATE", keyB3Fenced},
	{"P1 etcd Mutex, distinct keys", "P1 etcd Mutex Lock+Unlock", "distinct keys"},
	{"P2 Redis lock (no persistence), distinct keys", scenP2, "distinct keys"},
	{"P3 Redis lock (AOF fsync always), distinct keys", scenP3, "distinct keys"},
}

// writeChart draws throughput (median, log scale) against the number of
// clients for the scenarios run at several client counts.
func writeChart(path string, rows []Row, clients []int) error {
	p := plot.New()
	p.Title.Text = "Throughput vs concurrency (median; operations or cycles per second)"
	p.X.Label.Text = "concurrent clients"
	p.Y.Label.Text = "per second (log scale)"
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	ticks := make([]plot.Tick, len(clients))
	for i, c := range clients {
		ticks[i] = plot.Tick{Value: float64(i), Label: strconv.Itoa(c)}
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	p.Legend.Top = true
	p.Legend.Left = true
	palette := []color.RGBA{
		{0, 0, 0, 255}, {120, 120, 120, 255}, {0, 90, 200, 255}, {0, 160, 220, 255},
		{0, 150, 60, 255}, {200, 60, 0, 255}, {170, 0, 140, 255}, {220, 140, 0, 255}, {0, 40, 120, 255},
	}
	drawn := 0
	for li, l := range chartLines {
		var pts plotter.XYs
		for i, c := range clients {
			for _, r := range rows {
				if r.Scenario == l.scenario && r.Variant == l.variant && r.Clients == c && r.Measured() && r.Median > 0 {
					pts = append(pts, plotter.XY{X: float64(i), Y: r.Median})
				}
			}
		}
		if len(pts) == 0 {
			continue
		}
		line, points, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		col := palette[li%len(palette)]
		line.Color, points.Color = col, col
		points.Shape = draw.CircleGlyph{}
		if li%2 == 1 {
			line.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		p.Add(line, points)
		p.Legend.Add(l.label, line, points)
		drawn++
	}
	if drawn == 0 {
		return fmt.Errorf("nothing to chart")
	}
	p.X.Min, p.X.Max = -0.2, float64(len(clients)-1)+0.2
	// Headroom above the highest line (half a decade and more on the log
	// scale) for the legend in the top left corner.
	p.Y.Max *= 5
	return p.Save(9*vg.Inch, 6*vg.Inch, path)
}
