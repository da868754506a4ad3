package sim

import (
	"fmt"
	"html"
	"io"
	"strings"
)

// WriteSVG draws the report as a bar chart a person reads at a glance: one
// row per strategy, strict success (%) on the left, duplicates (records) on
// the right, our strategies set apart below the article's.
func (r *Report) WriteSVG(w io.Writer) error {
	const (
		rowH, top, labelW       = 28, 78, 190
		strictX, strictW        = labelW + 10, 300
		dupX, dupW              = strictX + strictW + 70, 200
		width                   = dupX + dupW + 50
		strictColor, dupColor   = "#2a9d8f", "#e76f51"
		oursColor, articleColor = "#1d3557", "#555"
	)
	maxDup := 1
	for _, res := range r.Results {
		maxDup = max(maxDup, res.Duplicates)
	}
	height := top + rowH*len(r.Results) + 50
	var b strings.Builder
	esc := html.EscapeString
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="Helvetica, Arial, sans-serif" font-size="13">`+"\n",
		width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="#fff"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="12" y="24" font-size="16" font-weight="bold">%s</text>`+"\n",
		esc(fmt.Sprintf("Strict success and duplicates per strategy — profile %s, %d tasks, seed %d", r.Profile, r.Tasks, r.Seed)))
	fmt.Fprintf(&b, `<text x="12" y="44" fill="#555">%s</text>`+"\n",
		esc(fmt.Sprintf("%s%% transient, %s%% hangs, %s%% malformed; a failing write stores its effect first %s%% of the time",
			pct(r.Transient), pct(r.Hang), pct(r.Malformed), pct(r.AmbiguousWindow))))
	fmt.Fprintf(&b, `<text x="%d" y="%d" font-weight="bold" fill="%s">strict success (%%) — higher is better</text>`+"\n", strictX, top-10, strictColor)
	fmt.Fprintf(&b, `<text x="%d" y="%d" font-weight="bold" fill="%s">duplicates (records) — 0 is right</text>`+"\n", dupX, top-10, dupColor)
	for i, res := range r.Results {
		y := top + i*rowH
		ours := res.Strategy == Ledger || res.Strategy == LedgerReconciler
		color, weight := articleColor, "normal"
		if ours {
			color, weight = oursColor, "bold"
		}
		if res.Strategy == Ledger && i > 0 {
			fmt.Fprintf(&b, `<line x1="12" y1="%d" x2="%d" y2="%d" stroke="#bbb" stroke-dasharray="4 3"/>`+"\n", y-3, width-12, y-3)
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end" fill="%s" font-weight="%s">%s</text>`+"\n",
			labelW, y+16, color, weight, esc(res.Strategy))
		sw := int(float64(strictW) * res.StrictPct / 100)
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="#eee"/>`+"\n", strictX, y+3, strictW, rowH-8)
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="%s"/>`+"\n", strictX, y+3, sw, rowH-8, strictColor)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%.1f%%</text>`+"\n", strictX+strictW+6, y+16, res.StrictPct)
		dw := dupW * res.Duplicates / maxDup
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="#eee"/>`+"\n", dupX, y+3, dupW, rowH-8)
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="%s"/>`+"\n", dupX, y+3, dw, rowH-8, dupColor)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%d</text>`+"\n", dupX+dupW+6, y+16, res.Duplicates)
	}
	fmt.Fprintf(&b, `<text x="12" y="%d" fill="#555" font-size="12">%s</text>`+"\n", height-18,
		esc("strict success: the right answer, exactly one draft and one post, no duplicate, no orphan. Bold: through the ledger."))
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}
