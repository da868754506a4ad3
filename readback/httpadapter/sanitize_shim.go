package httpadapter

import (
	"strings"
	"unicode/utf8"
)

// sanitizeText stands in for internal/sanitize.Text until the boundary
// stream's package is merged.
func sanitizeText(s string, limit int) (string, bool) {
	out := strings.ToValidUTF8(s, "\uFFFD")
	out = strings.ReplaceAll(out, "\x00", "\uFFFD")
	if len(out) > limit {
		cut := limit - len("…")
		for cut > 0 && !utf8.RuneStart(out[cut]) {
			cut--
		}
		out = out[:max(cut, 0)] + "…"
	}
	return out, out != s
}
