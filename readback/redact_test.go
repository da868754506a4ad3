package readback

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/redact"
)

// Issue 8, item 5: an adapter's error is redacted in every credential form
// and keeps its classification.
func TestRedactError(t *testing.T) {
	r := redact.New()
	r.AddHeader("Basic dXNlcjpzM2NyM3RwYXNz") // user:s3cr3tpass
	err := fmt.Errorf("GET /x: %w", PermanentError(errors.New(`HTTP 401: {"auth":"Basic dXNlcjpzM2NyM3RwYXNz","pass":"s3cr3tpass"}`)))
	red := RedactError(err, r)
	if strings.Contains(red.Error(), "s3cr3tpass") || strings.Contains(red.Error(), "dXNlcjpzM2NyM3RwYXNz") {
		t.Errorf("not redacted: %v", red)
	}
	if class, _ := Classify(red); class != Permanent {
		t.Errorf("class = %s, want permanent", class)
	}
	var e *Error
	if !errors.As(red, &e) || strings.Contains(e.Error(), "s3cr3tpass") {
		t.Errorf("the classified error is missing or not redacted: %v", e)
	}
	tr := RedactError(TransientError(errors.New("s3cr3tpass"), time.Second), r)
	if class, pause := Classify(tr); class != Transient || pause != time.Second {
		t.Errorf("transient class lost: %s %v", class, pause)
	}
	clean := errors.New("nothing secret")
	if RedactError(clean, r) != clean || RedactError(clean, nil) != clean {
		t.Errorf("a clean error was replaced")
	}
}
