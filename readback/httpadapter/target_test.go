package httpadapter_test

import (
	"context"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/readback"
)

// Issue 19, item 3: a receipt's target is recorded escaped (the request's
// escaped path), and reaches the API exactly as recorded: neither decoded
// nor escaped again. A GitLab-style target holding an escaped separator
// (/api/v4/projects/acme%2Fwidgets/issues/7) is read there, where the
// issue still exists: the delete did not happen (present). Escaped again
// (acme%252Fwidgets), the read got a 404, which for a delete is an
// authoritative absence: a delete that may never have happened settled
// succeeded. Characters a path cannot hold as they are (a '%' that starts
// no escape, a space) are still escaped. A target with a query or a
// fragment, which a path read would take for another resource (a 404: an
// absence to a delete), is refused, and so is an escaped dot segment.
func TestTargetReachesTheAPIAsRecorded(t *testing.T) {
	for _, tc := range []struct{ target, want string }{
		{"/api/v4/projects/acme%2Fwidgets/issues/7", "/api/v4/projects/acme%2Fwidgets/issues/7"},
		{"/api/v4/projects/acme%2fwidgets/issues/7", "/api/v4/projects/acme%2fwidgets/issues/7"},
		{"/files/r%C3%A9sum%C3%A9%20v2", "/files/r%C3%A9sum%C3%A9%20v2"},
		{"/files/100%/x", "/files/100%25/x"},
		{"/files/a b", "/files/a%20b"},
		{"/repos/acme/widgets/issues%3Fcreator=nobody", "/repos/acme/widgets/issues%3Fcreator=nobody"},
	} {
		t.Run(tc.target, func(t *testing.T) {
			rec := newPathAPI(t, tc.want, map[string]any{"id": "7", "title": "Old"})
			a := mustLoad(t, adapterFile("delete", "", rec.srv.URL, "fetch: {path: \"{receipt.target}\", id: /id}"))
			res, err := a.Check(context.Background(), testReceipt(tc.target))
			if err != nil {
				t.Fatal(err)
			}
			if res.Verdict != readback.VerdictPresent || !res.Authoritative {
				t.Fatalf("got %+v after requests %q; want present (the resource is still at %s)", res, rec.seen(), tc.want)
			}
			if uris := rec.seen(); len(uris) != 1 || strings.SplitN(uris[0], "?", 2)[0] != tc.want {
				t.Fatalf("requests %q, want one to %s", uris, tc.want)
			}
		})
	}
	for _, target := range []string{"/items/%2e%2e/admin", "/items/%2E/x", "/items/../x", "/items/7?force=true", "/items/7#x"} {
		t.Run(target, func(t *testing.T) {
			rec := newPathAPI(t, "/items", map[string]any{"id": "7"})
			a := mustLoad(t, adapterFile("delete", "", rec.srv.URL, "fetch: {path: \"{receipt.target}\", id: /id}"))
			res, err := a.Check(context.Background(), testReceipt(target))
			if class, _ := readback.Classify(err); err == nil || class != readback.Permanent || len(rec.seen()) != 0 {
				t.Fatalf("got %+v, %v, requests %q; want a permanent refusal and no request", res, err, rec.seen())
			}
		})
	}
}
