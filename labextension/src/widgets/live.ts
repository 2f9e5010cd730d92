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
// When a widget's kernel is gone, the widget manager marks every view of it disconnected: the panel's VBox
// and each of our views inside it. `gone()` disables each view's controls, but says "this shows a kernel
// that is gone" once per output: on the first of our views (class `om-view`) inside the outermost view
// marked, so that `%overmind status` (a cache table over a units bar) does not say it twice.

/**
 * The kernel this widget belongs to is gone (restarted or shut down): the widget manager marks its views
 * disconnected. Say so, and disable every control, instead of showing a live-looking dead kernel.
 */
export function gone(el: HTMLElement): void {
  let top = el.closest('.jupyter-widgets-disconnected');
  for (let up = top; up && up.parentElement; ) {
    up = up.parentElement.closest('.jupyter-widgets-disconnected');
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
  send(model, { event: 'view', shown: true });
  const redraw = (): void => {
    try {
      draw();
      ages(el);
      gone(el);
    } catch (error) {
      el.textContent = `overmind widget: ${error}`;
    }
  };
  const check = (): void => gone(el);
  for (const name of names) {
    model.on(`change:${name}`, redraw);
  }
  model.on('comm_live_update', check);
  const timer = window.setInterval(() => {
    ages(el);
    gone(el);
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
