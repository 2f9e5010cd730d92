/**
 * What every notebook widget's view does (overmind_jupyter/widgets/live.py `LiveView` is the kernel's
 * side): draw on every change of its traits, move its relative times on every second, tell the kernel
 * that the view exists and when it goes (Note [Widget polling] in widgets/polling.py), and say so when
 * its kernel is gone.
 */

import { h } from '../dom';
import { agoText } from '../texts';
import type { IPanelState } from '../api';
import type { IModel } from './anywidget';

/** Milliseconds between two refreshes of the relative times on show. */
const AGE_MS = 1000;

/** A relative time, written into `el` and kept moving while shown (see `ages`). */
export function agoAttrs(seconds: number): Record<string, string> {
  return { 'data-ago': String(seconds) };
}

/** Rewrite every relative time in place (a full redraw would replace a button under the pointer). */
export function ages(el: HTMLElement): void {
  el.querySelectorAll<HTMLElement>('[data-ago]').forEach(e => {
    e.textContent = Number(e.dataset.ago) ? agoText(Number(e.dataset.ago)) : 'never';
  });
}

// Note [One banner]
// When a widget's kernel restarts, the widget manager marks every view of it disconnected: the panel's VBox
// and each of our views inside it. `gone()` disables each view's controls, but says "this shows a kernel
// that is gone" once per output: on the first of our views (class `om-view`) inside the outermost view
// marked, so that `%overmind status` (a cache table over a units bar) does not say it twice.
//
// Note [A kernel shut down]
// ipywidgets marks views disconnected only when their kernel restarts. After Kernel > Shut Down, or a
// change of kernel, its manager just follows the notebook's session to no kernel or another one, and the
// views stayed as they were: a live-looking table whose Evict did nothing. So a view also takes its
// kernel for gone when its manager's kernel is no longer the one it was drawn for (none, another id, or
// dead), and marks the output's outermost widget view as the manager would (`om-gone-kernel`), so that
// the banner is said once per output there too.

/** The classes of a view whose kernel is gone: ipywidgets' (a restart), ours (Note [A kernel shut down]). */
const GONE = '.jupyter-widgets-disconnected, .om-gone-kernel';

/** Whether the kernel that `model`'s views were drawn for (`drawnFor`) is no longer its manager's. */
function kernelGone(model: IModel, drawnFor: string | undefined): boolean {
  const manager = model.widget_manager;
  if (!manager || !('kernel' in manager)) {
    return false; // a manager that does not say (another frontend): as before
  }
  const kernel = manager.kernel;
  return !kernel || kernel.isDisposed || kernel.status === 'dead' || kernel.id !== drawnFor;
}

/**
 * The kernel this widget belongs to is gone (restarted, shut down or replaced): say so, and disable
 * every control, instead of showing a live-looking dead kernel (Notes [One banner], [A kernel shut down]).
 */
export function gone(el: HTMLElement, model: IModel, drawnFor: string | undefined): void {
  if (kernelGone(model, drawnFor)) {
    const outer = el.closest('.jupyter-widgets') ?? el;
    let top = outer;
    for (let up = outer.parentElement?.closest('.jupyter-widgets'); up; ) {
      top = up;
      up = up.parentElement?.closest('.jupyter-widgets');
    }
    top.classList.add('om-gone-kernel');
  }
  let top = el.closest(GONE);
  for (let up = top; up && up.parentElement; ) {
    up = up.parentElement.closest(GONE);
    if (up) {
      top = up;
    }
  }
  const banner = el.querySelector(':scope > .om-gone');
  const first = top ? (top.querySelector('.om-view') ?? el) : null;
  if (top) {
    el.classList.add('om-dead');
    el.querySelectorAll<HTMLButtonElement>('button, input, select, textarea').forEach(c => {
      c.disabled = true;
    });
  } else {
    el.classList.remove('om-dead');
  }
  if (first === el && !banner) {
    el.prepend(
      h(
        'div',
        { class: 'om-w om-gone', 'data-testid': 'overmind-widget-gone' },
        'This shows a kernel that is gone (restarted or shut down): it no longer updates and its buttons ' +
          'do nothing. Run %overmind status again for the kernel running now.'
      )
    );
  } else if (first !== el && banner) {
    banner.remove();
  }
}

/**
 * Draw now and on every change of the traits `names`; refresh relative times every second; tell the
 * kernel that this view exists, and that it went when the frontend disposes of it. Returns the cleanup
 * anywidget calls then.
 */
export function live(model: IModel, el: HTMLElement, names: string[], draw: () => void): () => void {
  el.classList.add('om-view'); // one of ours, for gone()
  const drawnFor = model.widget_manager?.kernel?.id; // Note [A kernel shut down]
  send(model, { event: 'view', shown: true });
  const redraw = (): void => {
    try {
      draw();
      ages(el);
      gone(el, model, drawnFor);
    } catch (error) {
      el.textContent = `overmind widget: ${error}`;
    }
  };
  const check = (): void => gone(el, model, drawnFor);
  for (const name of names) {
    model.on(`change:${name}`, redraw);
  }
  model.on('comm_live_update', check);
  const timer = window.setInterval(() => {
    ages(el);
    gone(el, model, drawnFor);
  }, AGE_MS);
  redraw();
  return () => {
    window.clearInterval(timer);
    model.off('comm_live_update', check);
    for (const name of names) {
      model.off(`change:${name}`, redraw);
    }
    send(model, { event: 'view', shown: false });
  };
}

/** A message to the kernel; none once its comm closed (the kernel went). */
export function send(model: IModel, content: Record<string, unknown>): void {
  try {
    model.send(content);
  } catch {
    // the comm is closed
  }
}

/** The side panel's state in the `state` trait, or null while there is none (no daemon: {}). */
export function stateOf(model: IModel): IPanelState | null {
  const state = model.get('state');
  return state && state.state === 'ok' ? (state as IPanelState) : null;
}
